#!/usr/bin/env python3
"""Writes deploy/grafana/moongate.json: the dashboard is kept as code here (one place per
panel and query) and the JSON is generated. Every query is checked against a live
moongate by tests/all/dashboards.rs, which also checks that the JSON is what this
script writes. Run: python3 deploy/grafana/gen_dashboard.py [OUT] (default: moongate.json
beside it)"""
import os
import sys
import json
R = '[$__rate_interval]'
I = 'instance=~"$instance"'
NOTOK = 'result!="ok"'
HIT = 'result="hit"'
FOUND = 'outcome="found"'
def rate(m, extra=''):
    sel = I + (',' + extra if extra else '')
    return f'rate({m}{{{sel}}}{R})'
panels = []
y = 0
def row(title):
    global y
    panels.append({"type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
    y += 1
col = 0
def panel(title, targets, unit="short", kind="timeseries", desc=""):
    global y, col
    p = {"type": kind, "title": title, "description": desc,
         "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "gridPos": {"h": 8, "w": 8, "x": col * 8, "y": y},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": l,
                      "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                     for i, (e, l) in enumerate(targets)]}
    panels.append(p)
    col += 1
    if col == 3:
        col = 0; y += 8
def endrow():
    global y, col
    if col: y += 8
    col = 0

row("Master face")
panel("Requests by method", [(f'sum by (method) ({rate("moongate_master_requests_total")})', "{{method}}")], "reqps")
panel("Master latency p50 / p99 by method", [
    (f'histogram_quantile(0.5, sum by (method, le) ({rate("moongate_master_request_duration_seconds_bucket")}))', "p50 {{method}}"),
    (f'histogram_quantile(0.99, sum by (method, le) ({rate("moongate_master_request_duration_seconds_bucket")}))', "p99 {{method}}")], "s")
panel("Errors by method and kind", [(f'sum by (method, kind) ({rate("moongate_master_errors_total")})', "{{method}} {{kind}}")], "reqps",
      desc="rpc: transport error; app: ErrorCode in the answer (policy denials included); decode: a typed body that did not decode")
panel("Connections", [(f'sum(moongate_master_connections_open{{{I}}})', "open"),
                      (f'sum by (reason) ({rate("moongate_master_connections_closed_total")})', "closed: {{reason}}")])
panel("Upstream master", [(f'min(moongate_upstream_ready{{{I}}})', "ready"),
                          (f'min(moongate_upstream_leader_present{{{I}}})', "leader present"),
                          (f'max by (address) (moongate_upstream_leader{{{I}}})', "leader {{address}}")])
panel("Clients by Mooncake release", [(f'sum by (schema) (moongate_master_connections_by_schema{{{I}}})', "{{schema}}")])
endrow()
row("Policy")
panel("Decisions by plugin and arm", [(f'sum by (plugin, arm, decision) ({rate("moongate_policy_decisions_total")})', "{{arm}} {{plugin}} {{decision}}")], "reqps")
panel("Hook failures by plugin and arm", [(f'sum by (plugin, arm, hook, result) ({rate("moongate_policy_calls_total", NOTOK)})', "{{arm}} {{plugin}} {{hook}} {{result}}")], "reqps",
      desc="trap, timeout, oom, invalid, unavailable: the fail mode decided instead")
panel("Hook latency p99", [(f'histogram_quantile(0.99, sum by (plugin, hook, le) ({rate("moongate_policy_call_duration_seconds_bucket")}))', "{{plugin}} {{hook}}")], "s")
panel("Swaps, rollbacks, guardrail stops", [(f'max(moongate_policy_generation{{{I}}})', "generation"),
                                             (f'sum(increase(moongate_policy_rollbacks_total{{{I}}}[1h]))', "rollbacks (1 h)"),
                                             (f'sum(increase(moongate_policy_guardrail_stops_total{{{I}}}[1h]))', "guardrail stops (1 h)")])
endrow()
row("A/B: arms side by side")
panel("Lookup hit rate by arm", [(f'sum by (arm) ({rate("moongate_lookup_keys_total", HIT)}) / clamp_min(sum by (arm) ({rate("moongate_lookup_keys_total")}), 1e-9)', "{{arm}}")], "percentunit")
panel("Master latency p99 by arm", [(f'histogram_quantile(0.99, sum by (arm, le) ({rate("moongate_arm_request_duration_seconds_bucket")}))', "{{arm}}")], "s")
panel("Requests and errors by arm", [(f'sum by (arm) ({rate("moongate_arm_requests_total")})', "requests {{arm}}"),
                                     (f'sum by (arm, kind) ({rate("moongate_arm_errors_total")})', "errors {{arm}} {{kind}}")], "reqps")
panel("Bytes held by arm, and share", [(f'sum by (arm) (moongate_eviction_arm_bytes{{{I}}})', "held {{arm}}"),
                                       (f'sum by (arm) (moongate_eviction_arm_share_bytes{{{I}}})', "share {{arm}}")], "bytes")
panel("Evicted by arm", [(f'sum by (arm) ({rate("moongate_eviction_arm_removed_bytes_total")})', "{{arm}}")], "Bps")
panel("Lookup misses by reason", [(f'sum by (reason) ({rate("moongate_lookup_misses_total")})', "{{reason}}")], "ops",
      desc="never_stored, evicted_by_moongate, removed_by_client, refused_by_policy, evicted_by_master")
endrow()
row("Tiers and eviction")
panel("Bytes found per tier", [(f'sum by (tier) ({rate("moongate_tier_bytes_total", FOUND)})', "{{tier}}")], "Bps")
panel("Master memory usage", [(f'max(moongate_master_memory_usage_ppm{{{I}}}) / 1e6', "allocated / capacity")], "percentunit")
panel("Eviction", [(f'sum by (result) ({rate("moongate_eviction_keys_total")})', "victims {{result}}"),
                   (f'sum by (trigger) ({rate("moongate_eviction_rounds_total")})', "rounds {{trigger}}")], "ops")
panel("KV events for routers", [(f'sum by (type) ({rate("moongate_events_published_total")})', "published {{type}}"),
                                (f'sum({rate("moongate_events_dropped_total")})', "dropped (queue full)"),
                                (f'sum({rate("moongate_events_unmapped_keys_total")})', "keys naming no block")], "ops",
      desc="Events in vLLM's KV-event format, as [events] publishes them; drops are lost to routers.")
panel("Reads served per tier", [(f'sum by (tier) ({rate("moongate_served_keys_total")})', "{{tier}}")],
      desc="Keys readers were served, by the tier of the replica they read (memory, local_disk = an owner's SSD, unknown = not found); owners' offload lookups are not reads")
panel("SSD offload (owners)", [(f'sum({rate("moongate_offload_keys_total")})', "offloaded"),
                               (f'sum({rate("moongate_offload_failed_keys_total")})', "offload failed"),
                               (f'sum({rate("moongate_promotion_keys_total")})', "promoted")],
      desc="Keys owners wrote to their SSD, keys a notice named with no place on it (no SSD copy), keys promoted back to memory")
panel("SSD used per owner", [(f'max by (owner) (moongate_ssd_used_bytes{{{I}}})', "used {{owner}}"),
                             (f'max by (owner) (moongate_ssd_capacity_bytes{{{I}}})', "capacity {{owner}}")], "bytes",
      desc="Bytes on each owner's SSD as moongate follows them (offload notices, removals, lookup answers), against the capacity the owner reported")
panel("SSD reads through the owner face", [(f'sum({rate("moongate_owner_face_read_bytes_total")})', "read from SSD")], "Bps",
      desc="Bytes owners staged from their SSD for ranks' reads through moongate ([owner_face]); moongate_owner_face_staged_bytes is what they hold staged now")
endrow()
row("kv face")
panel("kv requests by op and status", [(f'sum by (op, status) ({rate("moongate_kv_requests_total")})', "{{op}} {{status}}")], "reqps")
panel("kv busy answers (503)", [(f'sum({rate("moongate_kv_busy_total")})', "byte budget full"),
                                (f'sum({rate("moongate_kv_master_busy_total")})', "master pool full")], "reqps")
panel("kv bytes by transport", [(f'sum by (transport, direction) ({rate("moongate_kv_transfer_bytes_total")})', "{{transport}} {{direction}}")], "Bps")
endrow()

dash = {
  "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
  "title": "moongate", "uid": "moongate", "tags": ["moongate", "mooncake"], "timezone": "browser",
  "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
  "description": "moongate: master face, policies and A/B arms, tiers, eviction and KV events, kv face. Every query is checked against a live moongate by tests/all/dashboards.rs.",
  "templating": {"list": [
    {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
    {"name": "instance", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
     "query": "label_values(moongate_upstream_ready, instance)", "includeAll": True, "multi": True,
     "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2}]},
  "panels": panels,
}
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "moongate.json")
json.dump(dash, open(out, "w"), indent=2)
print("wrote", out)
print(len([p for p in panels if p["type"] != "row"]), "panels")
