#!/usr/bin/env bash
# deploy/Containerfile's steps, run on this machine (CI reaches no container registry,
# so the base images cannot be pulled here): the builder stage (wasm32-wasip2 target,
# locked build), the final stage's files in a staging root, the shared libraries the
# final image must provide, and the image's commands run as its non-root user.
#   bash deploy/container-steps.sh [--profile dist|release|dev|count] [STAGING_DIR]
# (the image builds `dist`; CI runs these steps on `count`, already built beside its tests)
# STAGING_DIR (default target/container-root) and its parents must be readable by uid
# 65532, as the image's files are.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
profile=dist
if [ "${1:-}" = "--profile" ]; then
  profile=$2
  shift 2
fi
stage=${1:-target/container-root}
if [ -e "$stage" ]; then
  if [ "$stage" != target/container-root ]; then
    echo "error: $stage exists; give a new directory" >&2
    exit 2
  fi
  rm -rf "$stage"
fi
# Cargo's output directory of a profile: its name, but `debug` for `dev`.
out=target/$profile
[ "$profile" != "dev" ] || out=target/debug

echo "== builder: target and locked build ($profile)"
rustup target add wasm32-wasip2 >/dev/null
cargo build --profile "$profile" --locked --bin moongate

echo "== final stage: the image's files"
mkdir -p "$stage"
chmod 0755 "$stage"
install -D -m 0755 "$out/moongate" "$stage/usr/local/bin/moongate"
install -D -m 0644 config/example.toml "$stage/etc/moongate/moongate.toml"
chmod -R a+rX "$stage"

echo "== the final image provides every library the binary links"
# distroless cc-debian12: glibc (libc, libm, ld-linux) and libgcc_s; nothing else.
extra=$(ldd "$stage/usr/local/bin/moongate" | awk '{print $1}' \
  | grep -Ev '^(linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|libgcc_s\.so\.1|/lib64/ld-linux-x86-64\.so\.2)$' || true)
if [ -n "$extra" ]; then
  echo "error: the binary links libraries the final image lacks: $extra" >&2
  exit 1
fi

echo "== the image's commands, as USER 65532:65532"
as_user=()
if [ "$(id -u)" -eq 0 ]; then
  as_user=(setpriv --reuid=65532 --regid=65532 --clear-groups --)
  # A checkout under a private directory (`mktemp -d` is 0700) hides the staged files
  # from uid 65532 though they are readable in the image: copy them to a fresh
  # world-readable directory and run them there.
  if ! "${as_user[@]}" test -r "$stage/etc/moongate/moongate.toml"; then
    outside=$(mktemp -d)
    chmod 0755 "$outside"
    trap 'rm -rf "$outside"' EXIT
    cp -a "$stage/." "$outside/"
    stage=$outside
    echo "(the checkout is private to its owner: running the staged files from $stage)"
  fi
else
  echo "(not root: cannot switch to uid 65532; running as $(id -u))"
fi
"${as_user[@]}" "$stage/usr/local/bin/moongate" --help >/dev/null
"${as_user[@]}" "$stage/usr/local/bin/moongate" check-config "$stage/etc/moongate/moongate.toml"
echo "container steps: ok"
