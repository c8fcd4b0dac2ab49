"""A model's weights moved into transparent huge pages.

A decoding step reads every weight once: 1.2 GB for the default int4 target, which in 4 KiB pages is some 300,000
page translations per step. Moved into one anonymous mapping advised MADV_HUGEPAGE, the same bytes sit in about 600
pages of 2 MiB (`python -m benchmarks.huge_pages` measures what that buys). Linux's default THP mode, `madvise`,
gives huge pages only to memory that asks for them: a mapped file and torch's own allocations do not.

Where the kernel gives no huge pages (THP `never`, not Linux, memory too fragmented), the mapping keeps 4 KiB pages
and the move costs only its copy.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch
from torch import nn

from engine.loading.gguf_load import GGUFEmbedding

log = logging.getLogger(__name__)

HUGE = 2 << 20  # bytes in an x86-64 huge page
PLACEMENT = "anonymous, MADV_HUGEPAGE"  # part of a calibration's key: passes timed in other pages cost otherwise
ALIGN = 64  # each tensor starts on a cache line, as torch's allocator places them
EMBEDDINGS = (nn.Embedding, GGUFEmbedding)


def move(model: nn.Module) -> int:
    """Copy the weights of `model` that its passes read in full (all but an embedding's rows, of which a pass reads a
    few) into one anonymous mapping advised MADV_HUGEPAGE, in place: the tensors keep their objects, and a tensor
    shared by two modules stays shared. Returns the bytes of that mapping now in huge pages (0 where it got none).

    A tensor mapped from a file (a stored target) is read from the file (pread), not copied through its mapping:
    faulting in 4 KiB pages one by one cost 4.6 s for the default target where reading took a fraction of that (a
    2-core AMD EPYC VM), and the process never holds the file's pages beside the copy."""
    tensors = read_in_full(model)
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
    with _Files() as files:
        for t in tensors:
            place = memory[at:at + t.nbytes].view(t.dtype).view(t.shape)
            source = files.where(t) if t.is_contiguous() else None
            if source is None:
                place.copy_(t.data)
            else:
                _read_into(memoryview(region)[at:at + t.nbytes], *source)
            t.data = place
            at += _padded(t.nbytes)
    huge = mapping(memory.data_ptr()).get("AnonHugePages", "0 kB")
    return 1024 * int(huge.split()[0])


def read_in_full(model: nn.Module) -> list[torch.Tensor]:
    """The plain CPU tensors held by `model`'s modules other than embeddings, each once."""
    tensors = {id(t): t for m in model.modules() if not isinstance(m, EMBEDDINGS)
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
               if t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized}
    return list(tensors.values())


class _Files:
    """This process's mappings of files (/proc/self/maps), to find where in which file a mapped tensor's bytes are."""

    def __enter__(self) -> _Files:
        self.maps, self.fds = [], {}
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/"):
                        low, high = (int(x, 16) for x in fields[0].split("-"))
                        self.maps.append((low, high, int(fields[2], 16), int(fields[4]), fields[5].rstrip("\n")))
        except OSError:
            pass
        return self

    def where(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(an open descriptor of the file, the offset in it) of contiguous `t`'s bytes, or None if not mapped."""
        start, end = t.data_ptr(), t.data_ptr() + t.nbytes
        for low, high, offset, inode, path in self.maps:
            if low <= start and end <= high:
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
    """The /proc/self/smaps fields of the mapping that holds `address` ({} where there is no such file): its sizes
    ("AnonHugePages": "1280000 kB") and "VmFlags" ("hg": advised MADV_HUGEPAGE)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if not head.endswith(":"):  # a mapping's first line: "low-high perms offset ..."
                    if fields:
                        return fields
                    low, high = (int(x, 16) for x in head.split("-"))
                    fields = {"range": head} if low <= address < high else {}
                elif fields:
                    fields[head[:-1]] = rest.strip()
    except OSError:
        pass
    return fields
