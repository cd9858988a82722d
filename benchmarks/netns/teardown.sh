#!/usr/bin/env bash
# Remove every namespace and link setup.sh created (names mfb-r*, mfbh*, mfbbr). Idempotent.
set -u
if [[ $EUID -ne 0 ]]; then echo "teardown.sh: needs root" >&2; exit 1; fi
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^mfb-r' || true); do
  ip netns del "$ns"
done
for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^mfbh[0-9]+$' || true); do
  ip link del "$l" 2>/dev/null || true   # usually gone with its namespace peer
done
ip link del mfbbr 2>/dev/null || true
echo "netns removed"
