"""The models' weights moved into transparent huge pages.

A decoding step reads every weight once: 1.2 GB for the default int4 target, which in 4 KiB pages is some 300,000
page translations per step, and a draft token the draft's 0.37 GB. Moved into one anonymous mapping advised
MADV_HUGEPAGE, the same bytes sit in pages of 2 MiB (`python -m benchmarks.huge_pages` measures what that buys).
Linux's default THP mode, `madvise`, gives huge pages only to memory that asks for them: a mapped file and torch's
own allocations do not.

Where the kernel gives no huge pages (THP `never`, not Linux, memory too fragmented), the mapping keeps 4 KiB pages
and the move costs only its copy.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch
from torch import nn

from engine.loading.gguf_load import GGUFEmbedding

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes in an x86-64 huge page
PLACEMENT = "target and draft: anonymous, MADV_HUGEPAGE"  # in a calibration's key: other pages, other costs
ALIGN = 64  # each tensor starts on a cache line, as torch's allocator places them
RELEASE_EVERY = 64 << 20  # bytes copied between two hand-backs of the memory they were copied from
EMBEDDINGS = (nn.Embedding, GGUFEmbedding)


def move(*models: nn.Module) -> int:
    """Copy the `models`' parameters and buffers that their passes read in full (all but an embedding's rows, of
    which a pass reads a few) into one anonymous mapping advised MADV_HUGEPAGE, in place, before their first pass:
    the tensors keep their objects, so a tensor two modules hold stays shared; each becomes contiguous, and two
    distinct tensors over one storage no longer share it. Weights kept outside parameters and buffers (fbgemm's or
    oneDNN's packed ones) stay where they are. Returns the bytes of that mapping now in huge pages (0 where it got
    none).

    A tensor mapped from a file that nothing wrote to (a stored target) is read from the file (pread), not copied
    through its mapping, whose 4 KiB pages would fault in one by one: the default target's move took 2.6 s so
    against 4.6 s (a 2-core AMD EPYC VM), and the process never holds the file's pages beside the copy."""
    tensors = list({id(t): t for model in models for t in read_in_full(model)}.values())
    size = sum(_padded(t.nbytes) for t in tensors)
    if not size:
        return 0
    region = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as e:  # no THP in this kernel or no madvise here: 4 KiB pages
        log.info("no huge pages for the weights (%s)", e)
    memory = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive as long as any tensor uses it
    at = -memory.data_ptr() % HUGE  # the first tensor on a huge page's boundary
    through_mapping = copied = 0
    with _Files() as files:
        for t in tensors:
            place = memory[at:at + t.nbytes].view(t.dtype).view(t.shape)
            source = files.where(t) if t.is_contiguous() else None
            if source is None:
                through_mapping += t.nbytes if files.mapped(t) else 0
                place.copy_(t.data)
                copied += t.nbytes
            else:
                _read_into(memoryview(region)[at:at + t.nbytes], *source)
            t.data = place
            at += _padded(t.nbytes)
            if copied >= RELEASE_EVERY:  # so that at most this much is resident twice, in the copy and its source
                _release_freed()
                copied = 0
    if through_mapping:  # its pages now count against this process for as long as the file stays mapped
        log.warning("%.2f GB of weights copied through a file's mapping, not read from the file", through_mapping / 1e9)
    _release_freed()
    huge = mapping(memory.data_ptr()).get("AnonHugePages", "0 kB")
    return 1024 * int(huge.split()[0])


def _release_freed() -> None:
    """Give the freed copies' pages back to the system. glibc keeps freed memory in its heaps, where it still counts
    against the process: the default draft, read by a loading thread into that thread's heap, stayed resident after
    its move (0.28 GiB more RSS, measured)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


def read_in_full(model: nn.Module) -> list[torch.Tensor]:
    """The plain CPU tensors held by `model`'s modules other than embeddings, each once."""
    tensors = {id(t): t for m in model.modules() if not isinstance(m, EMBEDDINGS)
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
               if t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized}
    return list(tensors.values())


class _Files:
    """This process's mappings of files (/proc/self/smaps), to find where in which file a mapped tensor's bytes are.
    A mapping with private pages (written to since it was mapped) holds other bytes than its file: not read."""

    def __enter__(self) -> _Files:
        self.fds = {}
        # [low, high, offset, inode, path, clean]
        self.maps = [[low, high, offset, inode, path, fields.get("Anonymous", "0 kB").split()[0] == "0"]
                     for (low, high, offset, inode, path), fields in _smaps() if path.startswith("/")]
        return self

    def mapped(self, t: torch.Tensor) -> bool:
        return any(low <= t.data_ptr() < high for low, high, *_ in self.maps)

    def where(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(an open descriptor of the file, the offset in it) of contiguous `t`'s bytes, or None if not mapped from
        a file that still holds them."""
        start, end = t.data_ptr(), t.data_ptr() + t.nbytes
        for low, high, offset, inode, path, clean in self.maps:
            if low <= start and end <= high:
                if not clean:
                    return None
                try:
                    if path not in self.fds:
                        self.fds[path] = os.open(path, os.O_RDONLY)
                except OSError:  # gone or unreadable since it was mapped: copy through the mapping
                    return None
                if os.fstat(self.fds[path]).st_ino != inode:  # replaced since: not the bytes mapped
                    return None
                return self.fds[path], offset + start - low
        return None

    def __exit__(self, *_) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _read_into(buffer: memoryview, fd: int, offset: int) -> None:
    while buffer:
        n = os.preadv(fd, [buffer], offset)
        if n <= 0:
            raise OSError(f"the weights' file ended {len(buffer)} bytes early")
        buffer, offset = buffer[n:], offset + n


def _padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address` ({} where there is none): its sizes
    ("AnonHugePages": "1280000 kB"), "VmFlags" ("hg": advised MADV_HUGEPAGE) and "range"."""
    for (low, high, *_), fields in _smaps():
        if low <= address < high:
            return fields | {"range": f"{low:x}-{high:x}"}
    return {}


def _smaps():
    """Each mapping of this process as ((low, high, file offset, inode, path), {field: value}) from /proc/self/smaps
    (nothing where there is no such file)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.readlines()
    except OSError:
        return
    head, fields = None, {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.endswith(":"):
            fields[name[:-1]] = rest.strip()
            continue
        if head:  # a mapping's first line: "low-high perms offset dev inode path"
            yield head, fields
        parts = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in parts[0].split("-"))
        head = (low, high, int(parts[2], 16), int(parts[4]), parts[5].rstrip("\n") if len(parts) == 6 else "")
        fields = {}
    if head:
        yield head, fields
