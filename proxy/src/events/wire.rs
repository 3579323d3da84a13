//! vLLM's KV-event wire format: a msgpack `KVEventBatch` as `vllm/distributed/kv_events.py`
//! declares it with msgspec, in either of the encodings vLLM has used:
//!
//! ```text
//! map (current; events are tagged maps, omit_defaults=True):
//!   batch   = {"ts": float64, "events": [event, ...]}      (data_parallel_rank omitted)
//!   event   = {"type": "BlockStored", "block_hashes": [hash, ...],
//!              "parent_block_hash": hash | nil, "token_ids": [], "block_size": n,
//!              "lora_id": nil, "medium": str | nil, "lora_name": nil
//!              [, "group_idx": n]}
//!           | {"type": "BlockRemoved", "block_hashes": [hash, ...], "medium": str | nil
//!              [, "group_idx": n]}
//!           | {"type": "AllBlocksCleared"}
//! array (before; array_like=True, trailing defaults omitted):
//!   batch   = [ts: float64, [event, ...]]
//!   event   = ["BlockStored", [hash, ...], parent | nil, [token_id, ...], block_size,
//!              lora_id | nil, medium | nil]
//!           | ["BlockRemoved", [hash, ...], medium | nil]
//!           | ["AllBlocksCleared"]
//! hash      = uint64 | bin (vLLM's ExternalBlockHash: int or the digest's bytes)
//! message   = [topic, seq as 8 bytes big-endian, batch]  (ZeroMQ multipart)
//! ```
//!
//! Fields without a default are written even when nil, as msgspec does; `group_idx` is
//! written when known and only in the map encoding (the array layout had no place for
//! it). In a `BlockStored`, `block_hashes` is one chain: block i's parent is block i-1,
//! and `parent_block_hash` is the parent of the first. Pure: values in, bytes out.

use rmp::encode as mp;

/// Which of vLLM's encodings a batch takes (`events.encoding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Tagged maps: vLLM's current encoding (with `group_idx`).
    #[default]
    Map,
    /// Positional arrays: vLLM's encoding before the maps, for routers that still parse it.
    Array,
}

/// A block hash on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hash {
    Int(u64),
    /// A digest's bytes (msgpack `bin`).
    Bytes(Vec<u8>),
}

/// One KV event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored {
        hashes: Vec<Hash>,
        parent: Option<Hash>,
        medium: Option<&'static str>,
        /// vLLM's `group_idx`, when the keys say.
        group: Option<u32>,
    },
    Removed {
        hashes: Vec<Hash>,
        medium: Option<&'static str>,
        group: Option<u32>,
    },
    Cleared,
}

impl Event {
    /// The event's type name on the wire (its msgspec tag), also a metric label.
    pub fn tag(&self) -> &'static str {
        super::metrics::EVENT_TYPES[self.index()]
    }

    /// Its place in [`super::metrics::EVENT_TYPES`].
    pub fn index(&self) -> usize {
        match self {
            Event::Stored { .. } => 0,
            Event::Removed { .. } => 1,
            Event::Cleared => 2,
        }
    }
}

/// The sequence number frame: 8 bytes, big-endian, as vLLM's subscribers read it.
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// The replay stream's end marker: -1 as a signed 8-byte big-endian integer.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Encodes one batch (`ts`: seconds since the Unix epoch). `block_tokens`: the
/// `block_size` field (tokens per block); token ids are not known to moongate and go as
/// an empty list.
pub fn encode_batch(
    ts: f64,
    events: &[Event],
    block_tokens: u64,
    encoding: Encoding,
    out: &mut Vec<u8>,
) {
    // Writing into a Vec cannot fail: the results carry no information.
    let map = encoding == Encoding::Map;
    if map {
        let _ = mp::write_map_len(out, 2);
        let _ = mp::write_str(out, "ts");
    } else {
        let _ = mp::write_array_len(out, 2);
    }
    let _ = mp::write_f64(out, ts);
    if map {
        let _ = mp::write_str(out, "events");
    }
    let _ = mp::write_array_len(out, events.len() as u32);
    for e in events {
        let mut f = Fields { out, map };
        match e {
            Event::Stored {
                hashes,
                parent,
                medium,
                group,
            } => {
                f.start(e.tag(), 7, group.is_some());
                f.name("block_hashes");
                write_hashes(f.out, hashes);
                f.name("parent_block_hash");
                match parent {
                    Some(p) => write_hash(f.out, p),
                    None => {
                        let _ = mp::write_nil(f.out);
                    }
                }
                f.name("token_ids");
                let _ = mp::write_array_len(f.out, 0);
                f.name("block_size");
                let _ = mp::write_uint(f.out, block_tokens);
                f.name("lora_id");
                let _ = mp::write_nil(f.out);
                f.name("medium");
                write_medium(f.out, *medium);
                if map {
                    f.name("lora_name");
                    let _ = mp::write_nil(f.out);
                    f.group(*group);
                }
            }
            Event::Removed {
                hashes,
                medium,
                group,
            } => {
                f.start(e.tag(), 3, group.is_some());
                f.name("block_hashes");
                write_hashes(f.out, hashes);
                f.name("medium");
                write_medium(f.out, *medium);
                if map {
                    f.group(*group);
                }
            }
            Event::Cleared => f.start(e.tag(), 1, false),
        }
    }
}

/// Writes one event's fields as map entries or array elements.
struct Fields<'a> {
    out: &'a mut Vec<u8>,
    map: bool,
}

impl Fields<'_> {
    /// The event's header: the array (tag first, `array_len` elements) or the map (`type`
    /// first; `array_len` less the tag, plus `lora_name` for a store, plus `group_idx`).
    fn start(&mut self, tag: &str, array_len: u32, grouped: bool) {
        if self.map {
            let stored = tag == "BlockStored";
            let len = array_len + u32::from(stored) + u32::from(grouped);
            let _ = mp::write_map_len(self.out, len);
            let _ = mp::write_str(self.out, "type");
        } else {
            let _ = mp::write_array_len(self.out, array_len);
        }
        let _ = mp::write_str(self.out, tag);
    }

    fn name(&mut self, name: &str) {
        if self.map {
            let _ = mp::write_str(self.out, name);
        }
    }

    fn group(&mut self, group: Option<u32>) {
        if let Some(g) = group {
            let _ = mp::write_str(self.out, "group_idx");
            let _ = mp::write_uint(self.out, u64::from(g));
        }
    }
}

fn write_hash(out: &mut Vec<u8>, h: &Hash) {
    match h {
        Hash::Int(v) => {
            let _ = mp::write_uint(out, *v);
        }
        Hash::Bytes(b) => {
            let _ = mp::write_bin(out, b);
        }
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[Hash]) {
    let _ = mp::write_array_len(out, hashes.len() as u32);
    for h in hashes {
        write_hash(out, h);
    }
}

fn write_medium(out: &mut Vec<u8>, medium: Option<&str>) {
    match medium {
        Some(m) => {
            let _ = mp::write_str(out, m);
        }
        None => {
            let _ = mp::write_nil(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(v: &[u64]) -> Vec<Hash> {
        v.iter().map(|&h| Hash::Int(h)).collect()
    }

    fn each_event() -> Vec<Event> {
        vec![
            Event::Stored {
                hashes: ints(&[1, 300]),
                parent: None,
                medium: Some("MEMORY"),
                group: None,
            },
            Event::Removed {
                hashes: ints(&[7]),
                medium: None,
                group: None,
            },
            Event::Cleared,
        ]
    }

    fn s(out: &mut Vec<u8>, v: &str) {
        // fixstr: the strings here are all under 32 bytes.
        out.push(0xa0 | v.len() as u8);
        out.extend_from_slice(v.as_bytes());
    }

    /// Bytes worked out by hand from the msgpack spec, so the encoder is checked against
    /// the format, not against itself.
    #[test]
    fn a_batch_of_each_event_is_vllms_array_msgpack() {
        let mut out = Vec::new();
        encode_batch(1.5, &each_event(), 16, Encoding::Array, &mut out);
        let mut want = vec![0x92, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        // ["BlockStored", [1, 300], nil, [], 16, nil, "MEMORY"]
        want.extend_from_slice(&[0x97, 0xab]);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x92, 0x01, 0xcd, 0x01, 0x2c, 0xc0, 0x90, 0x10, 0xc0, 0xa6]);
        want.extend_from_slice(b"MEMORY");
        // ["BlockRemoved", [7], nil]
        want.extend_from_slice(&[0x93, 0xac]);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0x07, 0xc0]);
        // ["AllBlocksCleared"]
        want.extend_from_slice(&[0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(out, want);
    }

    #[test]
    fn a_batch_of_each_event_is_vllms_map_msgpack() {
        let mut events = each_event();
        if let Event::Stored { group, .. } = &mut events[0] {
            *group = Some(2);
        }
        let mut out = Vec::new();
        encode_batch(1.5, &events, 16, Encoding::Map, &mut out);
        let mut want = vec![0x82];
        s(&mut want, "ts");
        want.push(0xcb);
        want.extend_from_slice(&1.5f64.to_be_bytes());
        s(&mut want, "events");
        want.push(0x93);
        // {type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
        //  lora_name, group_idx}: 9 entries.
        want.push(0x89);
        for (k, v) in [
            ("type", None),
            ("block_hashes", Some(&[0x92, 0x01, 0xcd, 0x01, 0x2c][..])),
            ("parent_block_hash", Some(&[0xc0][..])),
            ("token_ids", Some(&[0x90][..])),
            ("block_size", Some(&[0x10][..])),
            ("lora_id", Some(&[0xc0][..])),
            ("medium", None),
            ("lora_name", Some(&[0xc0][..])),
            ("group_idx", Some(&[0x02][..])),
        ] {
            s(&mut want, k);
            match (k, v) {
                ("type", _) => s(&mut want, "BlockStored"),
                ("medium", _) => s(&mut want, "MEMORY"),
                (_, Some(bytes)) => want.extend_from_slice(bytes),
                _ => unreachable!(),
            }
        }
        // {type, block_hashes, medium}: no group, no entry.
        want.push(0x83);
        s(&mut want, "type");
        s(&mut want, "BlockRemoved");
        s(&mut want, "block_hashes");
        want.extend_from_slice(&[0x91, 0x07]);
        s(&mut want, "medium");
        want.push(0xc0);
        want.push(0x81);
        s(&mut want, "type");
        s(&mut want, "AllBlocksCleared");
        assert_eq!(out, want);
    }

    #[test]
    fn parents_and_large_hashes_are_unsigned_ints_and_digests_bin() {
        let mut out = Vec::new();
        encode_batch(
            0.0,
            &[Event::Stored {
                hashes: ints(&[u64::MAX]),
                parent: Some(Hash::Int(5)),
                medium: None,
                group: Some(1),
            }],
            0,
            Encoding::Array,
            &mut out,
        );
        let tail = &out[out.len() - 15..];
        // [u64::MAX] as uint64, parent 5, [], 0, nil, nil; no group in an array
        assert_eq!(tail[..3], [0x91, 0xcf, 0xff]);
        assert_eq!(tail[10..], [0x05, 0x90, 0x00, 0xc0, 0xc0][..]);
        assert_eq!(seq_frame(258), [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(END_SEQ, [0xff; 8]);

        let mut out = Vec::new();
        encode_batch(
            0.0,
            &[Event::Removed {
                hashes: vec![Hash::Bytes(vec![0xab; 32])],
                medium: None,
                group: None,
            }],
            0,
            Encoding::Array,
            &mut out,
        );
        // ["BlockRemoved", [bin8 of 32 bytes], nil]
        let at = out.len() - 36;
        assert_eq!(out[at..at + 3], [0x91, 0xc4, 32]);
        assert_eq!(out[at + 3..at + 35], [0xab; 32]);
    }
}
