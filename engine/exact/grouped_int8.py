"""The target's Linears as 8-bit weight codes times int8 activations (llama.cpp's kind of arithmetic), each row exact.

Why: a decoding step of the 1.5B target on a 2-core CPU reads every weight once, and float16 (2 bytes a weight) is
as far as torch's own kernels go. "int8" stores each Linear as codes 0..120 in groups of 32 along the input, with a
float32 scale and low per group (1.25 bytes a weight), and quantizes each row of activations to int8 per group of
32 as the pass runs (llama.cpp's Q8 activations). The dot product of a group is an integer, the rest float32
(grouped_int8.cpp: AVX2, or AVX-512 VNNI where the CPU has it; compiled once on first use into the model cache).
Every output element comes from its own input row by one fixed sequence of operations, so a row gets the same bits
whatever the pass size: greedy speculative output equals the baseline's, with no padding
(tests/test_int8_target.py checks 1 to 300 rows). engine.exact.int8_store keeps the result on disk for the next
start.

"int4" (GroupedInt4Linear) runs the same arithmetic on 4-bit codes, two a byte: a GGUF's Q4_K and Q4_1 tensors keep
their own codes, scales and lows (a group of 32 either way), so those Linears compute with exactly the file's weights.
A Q4_K tensor's Linear (GroupedQ4KLinear) also keeps the file's form of its scales, which the kernel expands per group
as the pass runs: 0.58 bytes a weight against 0.75, for the same bits. A Q6_K tensor's Linear (GroupedQ6KLinear) keeps
its 6-bit codes and scales, one per 16 weights: 0.82 bytes a weight, as in the file, against 1.25 as int8 codes, and
exactly the file's weights.

What the int8 target computes is not the float32 model: the weights move by at most half a code step (a group's
range / 240; a Q4_K group of the GGUF has 16 levels and lands on the codes exactly when it uses both its extremes),
and each activation by at most half of its group's max / 127. README says how its greedy text compares with float32.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from engine.loading.gguf_dequant import SixBitTerms

log = logging.getLogger(__name__)

GROUP = 32  # weights (and activations) sharing one scale: a row of K inputs has K / GROUP groups
# codes 0..120: code * activation pairs must fit int16 in AVX2's maddubs (<= 127), and 120 steps hold the 15 steps of
# a GGUF Q4_K group (and the 3, 5 or 8 of other grids) exactly
LEVELS = 120
# the kernel, and a decoder layer's small operations around it (engine.exact.decoder), compiled into one module
SOURCES = tuple(Path(__file__).with_name(name) for name in ("grouped_int8.cpp", "decoder_layer.cpp"))


def unavailable() -> str | None:
    """Why this machine cannot run the kernel, or None."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"it needs a CPU with AVX2 (this one: {torch.backends.cpu.get_cpu_capability()})"
    if not (shutil.which("c++") or shutil.which("g++")) or not shutil.which("ninja"):
        return "it is compiled on first use and needs a C++ compiler and ninja (Debian: apt install g++ ninja-build)"
    return None


NAME = "specconsole_grouped_int8"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]
STALE_BUILD_S = 3600  # a private build directory this old was left by a start that was killed mid-compile


def build_key() -> str:
    """What the compiled module depends on: the sources, torch, Python, the machine's kind and the flags."""
    h = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES))
    h.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()} {CFLAGS} {LDFLAGS}".encode())
    return h.hexdigest()[:16]


@functools.cache
def kernel():
    """The compiled extension, built once per build_key() into the model cache and shared by every checkout.

    Each build runs in a private directory renamed into place when it is done: two consoles that start at once
    build twice at worst and never collide, and a start killed mid-compile leaves nothing a later one waits for
    (torch's own lock file in one shared build directory did: every later start hung)."""
    from torch.utils.cpp_extension import load

    from engine.cache import cache_dir

    kernels = cache_dir() / "kernels"
    built = kernels / f"grouped_int8-{build_key()}"
    library = built / f"{NAME}.so"
    if library.exists():
        return _import(library)
    kernels.mkdir(parents=True, exist_ok=True)
    for old in kernels.glob(".build-*"):
        if time.time() - old.stat().st_mtime > STALE_BUILD_S:
            shutil.rmtree(old, ignore_errors=True)
    build = Path(tempfile.mkdtemp(prefix=".build-", dir=kernels))
    log.info("compiling the int8 kernel into %s (once per machine: about a minute)", built)
    try:
        # copies: torch's load() appends its own libraries to the list it is given, which changed build_key()
        module = load(NAME, [str(source) for source in SOURCES], build_directory=str(build), extra_cflags=list(CFLAGS),
                      extra_ldflags=list(LDFLAGS))
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    try:
        build.rename(built)  # atomic; fails when another start got there first, with the same module
    except OSError:
        shutil.rmtree(build, ignore_errors=True)
    return module


def _import(library: Path):
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quantize(weight: torch.Tensor, chunk: int = 4096, levels: int = LEVELS
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> code [N, K] uint8 (0..levels), scale and low [N, K / GROUP] float32, so that
    weight ~ scale * code + low per group; `chunk` output rows at a time, to keep the temporaries small."""
    n, k = weight.shape
    code = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, k // GROUP)
    low = torch.empty(n, k // GROUP)
    for i in range(0, n, chunk):
        groups = weight[i: i + chunk].float().reshape(-1, k // GROUP, GROUP)  # [rows, groups, GROUP]
        lo, hi = groups.amin(-1), groups.amax(-1)
        step = (hi - lo) / levels
        steps = ((groups - lo[..., None]) / step.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
        code[i: i + chunk] = steps.round_().clamp_(0, levels).to(torch.uint8).reshape(-1, k)
        scale[i: i + chunk], low[i: i + chunk] = step, lo
    return code, scale, low


LANES = 16  # outputs in a block of the kernel's layout (grouped_int8.cpp)
SUPER = 8  # groups in a GGUF Q4_K super-block


def by_lanes(t: torch.Tensor) -> torch.Tensor:
    """[N, columns] -> [N16 / 16, columns, 16], N padded to a multiple of LANES with zero rows: a value per output
    row of a block side by side, as the kernel loads them."""
    t = nn.functional.pad(t, (0, 0, 0, -t.shape[0] % LANES))
    return t.reshape(-1, LANES, t.shape[1]).transpose(1, 2).contiguous()


def blocked_codes(code: torch.Tensor) -> torch.Tensor:
    """quantize's codes [N, K] in the kernel's layout: outputs padded to a multiple of LANES (zero codes), then
    [N16 / 16, groups, 512] holding code[16 b + j, 32 g + 4 q + t] at [b, g, 64 q + 4 j + t]."""
    code = nn.functional.pad(code, (0, 0, 0, -code.shape[0] % LANES))
    blocks, groups = code.shape[0] // LANES, code.shape[1] // GROUP
    code = code.reshape(blocks, LANES, groups, GROUP // 4, 4).permute(0, 2, 3, 1, 4)  # [b, g, q, j, t]
    return code.reshape(blocks, groups, GROUP * LANES).contiguous()


def blocked(code: torch.Tensor, scale: torch.Tensor, low: torch.Tensor):
    """quantize's tensors in the kernel's layout: blocked_codes(code), and scale, low [N16 / 16, groups, 16]."""
    return blocked_codes(code), by_lanes(scale), by_lanes(low)


def nibbled(code: torch.Tensor) -> torch.Tensor:
    """blocked's codes [blocks, groups, 512], each 0..15, as the kernel's 4-bit layout [blocks, groups, 256]: the
    codes of quad q = 2 p in the low nibbles of bytes [p, j, t], those of q = 2 p + 1 in the high ones."""
    pairs = code.reshape(*code.shape[:2], GROUP // 8, 2, 4 * LANES)  # [b, g, p, quad of the pair, j t]
    return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(*code.shape[:2], -1).contiguous()


def unnibbled(code: torch.Tensor) -> torch.Tensor:
    """nibbled's inverse: [blocks, groups, 256] -> [blocks, groups, 512]."""
    pairs = code.reshape(*code.shape[:2], GROUP // 8, 1, 4 * LANES)
    return torch.cat([pairs & 0x0F, pairs >> 4], dim=3).reshape(*code.shape[:2], -1)


def six_bit(code: torch.Tensor) -> torch.Tensor:
    """blocked_codes' codes [blocks, groups, 512], each 0..63, as the kernel's 6-bit layout [blocks, groups, 384]: per
    half of the group (quads 4 half .. 4 half + 3) three vectors of 64 bytes [j, t], vector k holding the code of quad
    4 half + k in its low 6 bits and bits 2 k, 2 k + 1 of quad 4 half + 3's in its top 2."""
    quads = code.reshape(*code.shape[:2], 2, 4, 4 * LANES)  # [b, g, half, quad, j t]
    last = quads[:, :, :, 3:]
    tops = torch.cat([(last >> 2 * k) & 0x03 for k in range(3)], dim=3) << 6  # [b, g, half, k, j t]
    return (quads[:, :, :, :3] | tops).reshape(*code.shape[:2], -1).contiguous()


def unsix_bit(code: torch.Tensor) -> torch.Tensor:
    """six_bit's inverse: [blocks, groups, 384] -> [blocks, groups, 512]."""
    vectors = code.reshape(*code.shape[:2], 2, 3, 4 * LANES)  # [b, g, half, k, j t]
    last = sum((vectors[:, :, :, k: k + 1] >> 6) << 2 * k for k in range(3))
    return torch.cat([vectors & 0x3F, last], dim=3).reshape(*code.shape[:2], -1)


def unblocked_codes(code: torch.Tensor, rows: int) -> torch.Tensor:
    """blocked_codes' inverse: [blocks, groups, 512] -> [rows, K], the padding's rows dropped."""
    blocks, groups, _ = code.shape
    code = code.reshape(blocks, groups, GROUP // 4, LANES, 4).permute(0, 3, 1, 2, 4)  # [b, j, g, q, t]
    return code.reshape(blocks * LANES, groups * GROUP)[:rows]


def unlaned(t: torch.Tensor, rows: int) -> torch.Tensor:
    """by_lanes' inverse: [N16 / 16, columns, 16] -> [rows, columns]."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:rows]


class GroupedInt8Linear(nn.Module):
    """nn.Linear as weight codes 0..LEVELS in groups of GROUP; float32 in, float32 out (see the module docstring)."""

    kind, levels = "int8", LEVELS

    def __init__(self, linear: nn.Linear, groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """`groups`: code, scale and low [N, K], [N, K / GROUP] x 2 to use instead of quantizing the weight."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.in_features % GROUP:
            raise ValueError(f"{self.kind} needs Linears whose input width is a multiple of {GROUP}, "
                             f"not {self.in_features}")
        code, scale, low = groups if groups is not None else quantize(linear.weight.detach(), levels=self.levels)
        if int(code.max()) > self.levels:
            raise ValueError(f"{self.kind} codes lie in 0..{self.levels}")
        code, scale, low = blocked(code, scale.float(), low.float())
        self.register_buffer("code", nibbled(code) if self.levels == 15 else code)
        self.register_buffer("scale", scale)
        self.register_buffer("low", low)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        # compiled now, while the model loads; AVX-512 VNNI where the CPU has it (tests set False to check AVX2's)
        self.vnni = kernel().vnni_supported()

    @classmethod
    def shell(cls, in_features: int, out_features: int, bias: bool) -> GroupedInt8Linear:
        """A layer whose tensors are meta tensors of the right shapes, to be filled by load_state_dict(...,
        assign=True) (engine.exact.int8_store: the stored form, mapped from disk)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = in_features, out_features
        blocks, groups = -(-out_features // LANES), in_features // GROUP
        with torch.device("meta"):
            layer.register_buffer("code", torch.empty(blocks, groups, GROUP * LANES, dtype=torch.uint8))
            layer.register_buffer("scale", torch.empty(blocks, groups, LANES))
            layer.register_buffer("low", torch.empty(blocks, groups, LANES))
            layer.register_buffer("bias", torch.empty(out_features) if bias else None)
        layer.vnni = kernel().vnni_supported()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel().linear(x, *self.operands())

    def operands(self) -> tuple:
        """What the kernel takes besides the input: the codes, this form's two tensors of scales, the bias, the
        output width and whether to use VNNI."""
        return self.code, self.scale, self.low, self.bias, self.out_features, self.vnni

    def kernel_operands(self, rows: int) -> tuple:
        """operands() for passes of up to `rows` rows (engine.exact.decoder): the kernel runs every pass."""
        return self.operands()

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """scale and low [N16 / 16, groups, 16] float32, as the kernel uses them."""
        return self.scale, self.low

    def unblocked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """code [N, K], scale and low [N, K / GROUP]: quantize's layout (for tests and error figures)."""
        code = self.code if self.code.shape[2] == GROUP * LANES else unnibbled(self.code)
        return unblocked_codes(code, self.out_features), *(unlaned(t, self.out_features) for t in self.scales())

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this layer stands for, in float32."""
        code, scale, low = self.unblocked()
        groups = code.float().reshape(self.out_features, -1, GROUP)
        return (groups * scale[..., None] + low[..., None]).reshape(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"


class GroupedInt4Linear(GroupedInt8Linear):
    """The same kernel on 4-bit codes (0..15, two a byte): 0.75 bytes a weight against 1.25. Built from a GGUF Q4_K or
    Q4_1 tensor's own codes, scales and lows (engine.loading.gguf_dequant.four_bit_groups), it computes with exactly
    the file's weights: a Q4_K sub-block and a Q4_1 block are each a group of 32 with w = scale * q + low, q in 0..15.
    `GroupedInt4Linear(linear)` quantizes a float Linear to 16 levels instead (small models in tests)."""

    kind, levels = "int4", 15

    @classmethod
    def shell(cls, in_features: int, out_features: int, bias: bool) -> GroupedInt4Linear:
        layer = super().shell(in_features, out_features, bias)
        with torch.device("meta"):
            layer.code = torch.empty(*layer.code.shape[:2], GROUP * LANES // 2, dtype=torch.uint8)
        return layer

    def extra_repr(self) -> str:
        return super().extra_repr() + ", 4-bit codes"


class GroupedQ4KLinear(GroupedInt4Linear):
    """A GGUF Q4_K tensor's Linear with its scales in the file's form: per output row and super-block of 8 groups
    float16 d and dmin (kept as -dmin), per group 6-bit sc and m (a byte each here), from which the kernel computes
    scale = float(d) * sc and low = float(-dmin) * m in float32 per group as the pass runs: bitwise four_bit_groups'
    -(float(dmin) * m), as float32 rounding is symmetric in sign. 18.5 bytes per 32 weights against
    GroupedInt4Linear's 24, and bitwise its outputs for the same tensor (tests/test_int4_target.py). A decoding step
    reads every weight once: 23 % fewer bytes for these layers."""

    def __init__(self, linear: nn.Linear, code: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                 m: torch.Tensor):
        """code [N, K] uint8 (0..15), d, dmin [N, K / 256] float16, sc, m [N, K / 32] uint8: four_bit_groups' terms."""
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.in_features % (GROUP * SUPER):
            raise ValueError(f"a Q4_K tensor's rows are super-blocks of {GROUP * SUPER}, not {self.in_features}")
        self.register_buffer("code", nibbled(blocked_codes(code)))
        # d and -dmin [blocks, supers, 2, 16], sc and m [blocks, groups, 2, 16]
        self.register_buffer("d_dmin", torch.stack([by_lanes(d), by_lanes(-dmin)], dim=2))
        self.register_buffer("sc_m", torch.stack([by_lanes(sc), by_lanes(m)], dim=2))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        self.vnni = kernel().vnni_supported()

    @classmethod
    def shell(cls, in_features: int, out_features: int, bias: bool) -> GroupedQ4KLinear:
        layer = super().shell(in_features, out_features, bias)
        blocks, groups = layer.code.shape[:2]
        del layer.scale, layer.low
        with torch.device("meta"):
            layer.register_buffer("d_dmin", torch.empty(blocks, groups // SUPER, 2, LANES, dtype=torch.float16))
            layer.register_buffer("sc_m", torch.empty(blocks, groups, 2, LANES, dtype=torch.uint8))
        return layer

    def operands(self) -> tuple:
        return self.code, self.d_dmin, self.sc_m, self.bias, self.out_features, self.vnni

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        d, negated_dmin = (t.float().repeat_interleave(SUPER, dim=1) for t in self.d_dmin.unbind(2))
        sc, m = (t.float() for t in self.sc_m.unbind(2))
        return d * sc, negated_dmin * m

    def extra_repr(self) -> str:
        return super().extra_repr() + ", Q4_K scales"


class GroupedQ6KLinear(GroupedInt8Linear):
    """A GGUF Q6_K tensor's Linear on its own terms (engine.loading.gguf_dequant.SixBitTerms): 6-bit codes q, and per
    16 weights a scale s = float(d) * sc (float16 d per super-block of 256, int8 sc) that the kernel computes as the
    pass runs, with w = s * (q - 32). 26.25 bytes per 32 weights, as in the file, against 40 for int8 codes of the
    same weights (which only approximate them); a decoding step reads every weight once."""

    kind, levels = "int6", 63

    def __init__(self, linear: nn.Linear, terms: SixBitTerms):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if self.in_features % (GROUP * SUPER):
            raise ValueError(f"a Q6_K tensor's rows are super-blocks of {GROUP * SUPER}, not {self.in_features}")
        self.register_buffer("code", six_bit(blocked_codes(terms.code)))
        self.register_buffer("d", by_lanes(terms.d))  # [blocks, supers, 16] float16
        self.register_buffer("sc", by_lanes(terms.sc))  # [blocks, 2 groups, 16] int8
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        self.vnni = kernel().vnni_supported()

    @classmethod
    def shell(cls, in_features: int, out_features: int, bias: bool) -> GroupedQ6KLinear:
        layer = super().shell(in_features, out_features, bias)
        blocks, groups = layer.code.shape[:2]
        del layer.scale, layer.low
        with torch.device("meta"):
            layer.code = torch.empty(blocks, groups, GROUP * LANES * 3 // 4, dtype=torch.uint8)
            layer.register_buffer("d", torch.empty(blocks, groups // SUPER, LANES, dtype=torch.float16))
            layer.register_buffer("sc", torch.empty(blocks, 2 * groups, LANES, dtype=torch.int8))
        return layer

    def operands(self) -> tuple:
        return self.code, self.d, self.sc, self.bias, self.out_features, self.vnni

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("a Q6_K layer has a scale per 16 weights and no low: unblocked() gives its terms")

    def unblocked(self) -> SixBitTerms:
        """The terms it was built from, in row order."""
        rows = self.out_features
        return SixBitTerms(unblocked_codes(unsix_bit(self.code), rows), unlaned(self.sc, rows), unlaned(self.d, rows))

    def dequantized(self) -> torch.Tensor:
        return six_bit_values(self.unblocked())

    def extra_repr(self) -> str:
        return super().extra_repr() + ", Q6_K codes and scales"


def six_bit_values(terms: SixBitTerms) -> torch.Tensor:
    """The weight [N, K] float32 that a Q6_K tensor's terms stand for, in _q6_k's float32 steps."""
    scale = terms.d.float().repeat_interleave(SUPER * 2, dim=1) * terms.sc.float()  # [N, K / 16]
    centred = terms.code.view(torch.int8) - 32
    return (scale[..., None] * centred.reshape(*scale.shape, GROUP // 2).float()).reshape(terms.code.shape)


def gives_back(terms: SixBitTerms, weight: torch.Tensor, chunk: int = 4096) -> bool:
    """Whether the terms' values are `weight` bit for bit; `chunk` rows at a time (the output layer's full-size
    temporaries would be 2 GB)."""
    return weight.shape[1] % (GROUP * SUPER) == 0 and all(
        torch.equal(six_bit_values(SixBitTerms(*(t[i: i + chunk] for t in terms))), weight[i: i + chunk])
        for i in range(0, weight.shape[0], chunk))


def int4_of_gguf(linear: nn.Linear, groups: tuple[torch.Tensor, ...]) -> GroupedInt8Linear:
    """The int4 target's converter for a Linear whose weight came from a GGUF Q4_K, Q4_1 or Q6_K tensor, given that
    tensor's four_bit_groups or SixBitTerms (engine.loading.gguf_load passes them): it keeps the file's own codes,
    and a Q4_K tensor's scales in the file's form (GroupedQ4KLinear); any other Linear of the int4 target (a float
    one) is a GroupedInt8Linear. The groups are used only if they give back the loaded weight bitwise (a loader that
    reorders rows would not); else int8 codes."""
    weight = linear.weight.detach()
    if isinstance(groups, SixBitTerms):
        if gives_back(groups, weight):
            return GroupedQ6KLinear(linear, groups)
        log.warning("a Q6_K tensor's terms do not give back its weight (%s): int8 codes instead", tuple(weight.shape))
        return GroupedInt8Linear(linear)
    code, scale, low, *terms = groups
    values = code.float().reshape(*scale.shape, GROUP) * scale[..., None] + low[..., None]
    if not torch.equal(values.reshape(weight.shape), weight):
        log.warning("a 4-bit tensor's groups do not give back its weight (%s): int8 codes instead", tuple(weight.shape))
        return GroupedInt8Linear(linear)
    if terms:
        d, dmin, sc, m = terms
        d, dmin = (t.float().repeat_interleave(SUPER, dim=1) for t in (d, dmin))
        if torch.equal(d * sc.float(), scale) and torch.equal(-(dmin * m.float()), low):
            return GroupedQ4KLinear(linear, code, *terms)
        log.warning("a Q4_K tensor's scale terms do not give its scales (%s): float32 ones", tuple(weight.shape))
    return GroupedInt4Linear(linear, (code, scale, low))
