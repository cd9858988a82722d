"""PeakMemory (dryrun/peak.py): the CPU allocator's peak over a block, storage resizes included,
against byte counts known by construction."""

from __future__ import annotations

import torch

from matrixfsdp.dryrun.peak import PeakMemory, storage_bytes


def test_peak_counts_allocations_frees_and_in_place_storage_resizes():
    kept = torch.zeros(1000)  # 4000 bytes live at entry
    with PeakMemory(lambda: storage_bytes([kept])) as pm:
        a = torch.empty(1_000_000)  # +4 MB
        b = torch.empty(500_000)  # +2 MB: 6 MB + 4000 live
        del a
        st = b.untyped_storage()
        st.resize_(0)  # what fully_shard's reshard does to a layer's unsharded buffers
        st.resize_(8_000_000)  # and its unshard: 8 MB + 4000 live, the peak
        del b, st
        torch.empty(10)
    assert pm.peak_bytes == 4000 + 8_000_000


def test_peak_is_the_highest_over_reentries_each_with_its_own_baseline():
    held = [torch.empty(250_000)]  # 1 MB live at the first entry, dropped between the two
    pm = PeakMemory(lambda: storage_bytes(held))
    with pm:
        y = torch.empty(500_000)  # +2 MB: 3 MB
        del y
    assert pm.peak_bytes == 3_000_000
    held.clear()
    with pm:
        y = torch.empty(600_000)  # 2.4 MB, below the first block's peak
        del y
    with PeakMemory(0) as small:
        torch.empty(10)
    assert pm.peak_bytes == 3_000_000 and small.peak_bytes == 40
    with pm:
        y = torch.empty(1_000_000)  # 4 MB: a new high
        del y
    assert pm.peak_bytes == 4_000_000


def test_storage_bytes_counts_each_storage_once():
    t = torch.empty(100)
    assert storage_bytes([t, t[10:], t.view(10, 10), None]) == 400
    assert storage_bytes([]) == 0
