"""A CPU device's weights moved onto 2 MiB pages. A decode step streams every weight once (~100 MB for the
embedded model) from memory; on 4 KiB pages each page costs a TLB miss and stops the hardware prefetchers, so a
cold stream runs well below what memory gives (a 30 MB sum on this project's 2-core Xeon VM: 7.3 GB/s on 4 KiB
pages, 11.2 on 2 MiB). XLA's CPU arrays live wherever malloc put them and cannot be allocated elsewhere;
MADV_COLLAPSE (Linux 6.1) moves the pages under them to huge pages in place, same addresses and contents, at
~3 ms a MiB. The KV cache is left as it is: its default 0.42 GiB would add 1.6 s to the start."""
from __future__ import annotations

import bisect
import ctypes
import logging
import sys

import jax

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25


def collapse_to_huge_pages(arrays: list[jax.Array]) -> int:
    """The 2 MiB regions that hold the arrays' buffers collapsed into huge pages; how many of the arrays' bytes
    lie in regions now collapsed. A region that is not wholly inside one mapping (the edge of a malloc arena) stays
    as it is; a kernel without MADV_COLLAPSE, or another OS, changes nothing (0)."""
    if sys.platform != "linux":
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    spans = [(s.data.unsafe_buffer_pointer(), s.data.nbytes) for a in arrays for s in a.addressable_shards]
    mappings = mapped_ranges()
    collapsed = {r for r in sorted({r for span in spans for r in regions(*span)})
                 if within_one_mapping(r, mappings) and madvise(r * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE) == 0}
    if not collapsed:
        log.info("huge pages: none collapsed (MADV_COLLAPSE needs Linux 6.1); weights stay on 4 KiB pages")
    return sum(min(start + n, (r + 1) * HUGE_PAGE) - max(start, r * HUGE_PAGE)
               for start, n in spans for r in regions(start, n) if r in collapsed)


def regions(start: int, nbytes: int) -> range:
    """The 2 MiB regions (address // HUGE_PAGE) that bytes [start, start + nbytes) touch."""
    return range(start // HUGE_PAGE, (start + nbytes - 1) // HUGE_PAGE + 1)


def mapped_ranges() -> list[tuple[int, int]]:
    """This process's mappings as sorted (start, end) address pairs (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split(maxsplit=1)[0].split("-")) for line in f]


def within_one_mapping(region: int, mappings: list[tuple[int, int]]) -> bool:
    """Whether one mapping holds the whole region: madvise succeeds on a region that straddles two mappings but
    collapses nothing there (each mapping's part is short of a huge page)."""
    i = bisect.bisect_right(mappings, (region * HUGE_PAGE, float("inf"))) - 1
    return i >= 0 and mappings[i][1] >= (region + 1) * HUGE_PAGE
