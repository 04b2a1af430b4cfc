"""Batch-1 greedy decoding with each decode step one call into C: the last lever on the bandwidth roof.

``benchmarks/decode.py`` measures every PyTorch path of this course, compiled or not, at a third to
a half of the memory-bandwidth bound of batch-1 decoding, depending on the machine and the format. Two costs
keep it there, both measured by
``benchmarks/decode_profile.py``: PyTorch's CPU matrix-vector kernels stream weights well below the
bandwidth the STREAM probe reads, and every step spends milliseconds between the products
(operator dispatch, the compiled graph's guards and wrappers, temporary tensors). A decode step at
batch 1 is only about 120 matrix-vector products with a little arithmetic between them, so
``NativeDecoder`` writes the step itself, in ``native/decode_step.c``:

* one call per token from Python; inside it nothing but the step's own arithmetic;
* each product's output rows split evenly between the threads of PyTorch's own OpenMP pool, each
  thread streaming four weight rows against one read of the input vector;
* the weights read where the model keeps them (``nn.Linear``'s ``[out, in]`` rows, no copy in
  fp32); q, k and v are one range of rows over three weights, gate and up one pass that multiplies
  ``silu(gate) * up`` as the rows come;
* the KV cache is ``StaticDecoder``'s: the prompt runs in PyTorch (``layer_step``, one pass),
  writing the same buffers the C step then reads and extends.

Weights are fp32 (the model's own tensors), bf16 (a copy of every projection and the output head,
2 bytes a weight, widened to fp32 in registers) or int8 (chapter 09's quantisation with one scale
per output row, as the int8 ``decode_layout`` quantises: 1 byte a weight, each row's sum scaled
once); activations and sums stay fp32 in every format. The
library is compiled once per machine with the system C compiler for this CPU (``cc -O3
-march=native``, 512-bit vectors where the CPU has them) and cached beside the course's other caches;
``native_decode_available()`` says
whether that worked and, if not, why.

Summation order differs from PyTorch's (four rows at a time, vectorised), so logits agree with
the model's within a few 1e-5 in fp32, and greedy tokens are the model's on the course's prompts;
a test checks both.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from infra_lib.cache_lock import cache_root, held
from infra_lib.model.compiled_decode import StaticDecoder
from infra_lib.model.decode_layout import Int8RowLinear
from infra_lib.model.model import MLP, Attention, Llama
from infra_lib.model.quant import Q4_1Linear, pack_int4, quantize_symmetric

SOURCE = Path(__file__).with_name("native") / "decode_step.c"
NATIVE_FORMATS = ("fp32", "bf16", "int8", "q4_1", "int4")
# each format as dims[D_FORMAT] names it (FORMAT_FP32... in C); q8_0 is the 4-bit steps' head
FORMAT_CODE = {"fp32": 0, "bf16": 1, "int8": 2, "q4_1": 3, "int4": 4, "q8_0": 5}
QUANTISED = ("q4_1", "int4")  # read in blocks of 32 weights, against int8-quantised activations
BLOCK = 32  # weights per block of the 4-bit formats and of the Q8_0 head
INT4_GROUP = 64  # weights per scale of the int4 step (chapter 09's default group)
MAX_INPUT = 16384  # the longest row a 4-bit product takes (MAX_Q_INPUT in C)
_POSITION, _TOKEN, _THREADS = 8, 9, 10  # the step's own fields of dims[] (D_POS, D_TOKEN, D_THREADS in C)
ABI = 5
# no -ffast-math: linking with it would set flush-to-zero for the whole process (PyTorch included);
# these four let the compiler reorder sums into vector lanes, which is all the step needs.
# -fno-strict-aliasing: the bf16 product reads pairs of 16-bit weights as 32-bit words.
FLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fno-strict-aliasing",
)
# Tuned for this CPU. On x86 with AVX-512, 512-bit vectors where the compiler would pick 256-bit
# ones: in two full runs of benchmarks/decode.py, bf16 went from 62% to 71% of its bound and int8
# from 46% to 59% (fp32, 80% and 82%, was already near its own). A compiler that refuses these
# gets a build without them.
TUNING = (
    ("-march=native", "-mprefer-vector-width=512")
    if platform.machine().lower() in ("x86_64", "amd64")
    else ("-mcpu=native",)
)


class NativeUnavailable(RuntimeError):
    """The C decode step could not be built or loaded here (no C compiler, a failed build)."""


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise NativeUnavailable(
        "no C compiler found (looked for $CC, cc, gcc, clang): install one, "
        "e.g. `apt-get install gcc`, or use StaticDecoder"
    )


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(line for line in lines if line.startswith(("model name", "flags")))[:4000]
    except OSError:
        return platform.processor() + platform.machine()


_LIBRARY: ctypes.CDLL | None = None
_FAILURE: str | None = None


def _build(cc: str, target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile the step into ``target``: tuned for this CPU (plus ``extra_flags``) and with OpenMP
    where the compiler can, else without (single-threaded without OpenMP)."""
    errors = []
    for tuning in ((*TUNING, *extra_flags), ()):
        for openmp in (("-fopenmp",), ()):
            flags = [*FLAGS, *tuning, *openmp]
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                run = subprocess.run(
                    [cc, *flags, "-o", str(out), str(SOURCE), "-lm"], capture_output=True, text=True, timeout=120
                )
                if run.returncode == 0:
                    os.replace(out, target)  # atomic: another process sees the whole library or none
                    return
                errors.append(f"{' '.join([Path(cc).name, *flags])}: {run.stderr.strip()[-800:]}")
    raise NativeUnavailable("the C decode step did not compile:\n" + "\n".join(errors))


def _built_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The step compiled with this module's flags (and ``extra_flags``), built once per source,
    compiler, CPU and flags, kept in the cache folder; loaded, its functions' types declared."""
    cc = _compiler()
    flags = FLAGS + TUNING + tuple(extra_flags)
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(flags).encode() + cc.encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    root = cache_root() / "native"
    target = root / f"decode_step-{key}.so"
    with held(root / f"decode_step-{key}.lock"):
        if not target.exists():
            root.mkdir(parents=True, exist_ok=True)
            _build(cc, target, tuple(extra_flags))
    library = ctypes.CDLL(str(target))
    if library.infra_native_abi() != ABI:
        raise NativeUnavailable(f"{target} speaks ABI {library.infra_native_abi()}, this module {ABI}")
    library.infra_native_decode_step.restype = ctypes.c_int
    library.infra_native_decode_step.argtypes = [
        ctypes.POINTER(ctypes.c_long),
        ctypes.c_float,
        ctypes.POINTER(ctypes.c_void_p),
    ] + [ctypes.c_void_p] * 8
    for name in (
        "infra_native_panel_width",
        "infra_native_batch_dim_count",
        "infra_native_batch_param_count",
        "infra_native_row_fields",
        "infra_native_q4_path",
    ):
        getattr(library, name).restype = ctypes.c_int
    library.infra_native_batch_step.restype = ctypes.c_int
    library.infra_native_batch_step.argtypes = [
        ctypes.POINTER(ctypes.c_long),
        ctypes.c_float,
        ctypes.POINTER(ctypes.c_void_p),
    ] + [ctypes.c_void_p] * 11
    for name in ("infra_native_scratch_floats", "infra_native_batch_scratch_floats"):
        getattr(library, name).restype = ctypes.c_long
        getattr(library, name).argtypes = [ctypes.POINTER(ctypes.c_long)]
    library.infra_native_profile.restype = ctypes.c_int
    library.infra_native_profile.argtypes = [ctypes.POINTER(ctypes.c_double)]
    return library


# the batch-1 step's phases in a profiling build (PROF_SERIAL... in C), in order
PROFILE_PHASES = ("serial", "fork/join", "quantise", "products", "attention", "head", "argmax")


def step_profile(library: ctypes.CDLL) -> dict[str, float] | None:
    """Seconds thread 0 of the batch-1 step spent in each phase since the last call (``PROFILE_PHASES``),
    from a library built with ``native_library(("-DINFRA_PROFILE",))``; None from any other build."""
    seconds = (ctypes.c_double * len(PROFILE_PHASES))()
    if library.infra_native_profile(seconds) != len(PROFILE_PHASES):
        return None
    return dict(zip(PROFILE_PHASES, seconds))


def native_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled step, built on first use and cached per source, compiler and CPU.

    ``extra_flags`` builds (and returns) a variant, for example ``("-mno-avx512f",)`` for the
    portable 4-bit products on a CPU that has AVX-512; the steps themselves use the plain build."""
    global _LIBRARY, _FAILURE
    if extra_flags:
        try:
            return _built_library(tuple(extra_flags))
        except (OSError, subprocess.SubprocessError) as error:
            raise NativeUnavailable(f"the C decode step could not be built or loaded: {error}") from error
    if _LIBRARY is not None:
        return _LIBRARY
    if _FAILURE is not None:
        raise NativeUnavailable(_FAILURE)
    try:
        _LIBRARY = _built_library()
    except NativeUnavailable as error:
        _FAILURE = str(error)
        raise
    except (OSError, subprocess.SubprocessError) as error:
        _FAILURE = f"the C decode step could not be built or loaded: {error}"
        raise NativeUnavailable(_FAILURE) from error
    return _LIBRARY


def native_decode_available() -> tuple[bool, str]:
    """(True, "") if the C step builds and loads here, else (False, why)."""
    try:
        native_library()
    except NativeUnavailable as error:
        return False, str(error)
    return True, ""


def data_pointer(t: torch.Tensor | None) -> int | None:
    """A tensor's address as the C steps take it; None (a NULL pointer) for a tensor a model lacks."""
    return None if t is None else t.data_ptr()


def fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor as the C steps read activations' companions (norms, biases, tables): contiguous fp32."""
    return None if t is None else t.detach().float().contiguous()


def take_shared_tensors(target, model: Llama) -> None:
    """What every C step reads as fp32, whatever its weight format: the embedding table, the final
    norm, the rope tables, and the norms' epsilon, set on ``target``."""
    target.embed = fp32(model.embed_tokens.weight)
    target.final_norm = fp32(model.norm.weight)
    target.cos, target.sin = fp32(model.rope_cos), fp32(model.rope_sin)
    target.eps = float(model.layers[0].input_layernorm.eps)


def check_native_model(model: Llama, weights: str, who: str, group_size: int = INT4_GROUP) -> None:
    """The C steps read an fp32 ``Llama`` as loaded on the CPU: ``nn.Linear`` projections, or for
    ``"q4_1"`` the GGUF file's blocks as ``load_gguf_q4_1`` keeps them (``Q4_1Linear``)."""
    if weights not in NATIVE_FORMATS:
        raise ValueError(f"weights must be one of {NATIVE_FORMATS}, got {weights!r}")
    if not isinstance(model, Llama):
        raise TypeError(f"{who} takes an infra_lib Llama, got {type(model).__name__}")
    if not (
        isinstance(model.lm_head, nn.Linear)
        and all(isinstance(layer.self_attn, Attention) and isinstance(layer.mlp, MLP) for layer in model.layers)
    ):
        raise TypeError(f"{who} reads nn.Linear weights: give it the model as loaded, not a decode_layout copy")
    kind = Q4_1Linear if weights == "q4_1" else nn.Linear
    if not all(isinstance(m, kind) for layer in model.layers for m in projections(layer)):
        if weights == "q4_1":
            raise TypeError(
                f"{who} with weights='q4_1' reads the GGUF file's Q4_1 blocks as stored: give it the model "
                "that infra_lib.model.quant.load_gguf_q4_1() loads"
            )
        raise TypeError(f"{who} reads nn.Linear weights: give it the model as loaded, not a quantised copy")
    parameter = next(model.parameters())
    if parameter.dtype != torch.float32 or parameter.device.type != "cpu":
        raise ValueError(f"{who} runs an fp32 model on the CPU, got {parameter.dtype} on {parameter.device}")
    if weights in QUANTISED:
        if weights == "int4" and (
            not isinstance(group_size, int) or group_size not in (BLOCK * 2**i for i in range(5))
        ):
            raise ValueError(f"the int4 step takes a group_size of 32, 64, 128, 256 or 512 weights, got {group_size!r}")
        unit = group_size if weights == "int4" else BLOCK
        for n in {
            model.config.hidden_size,
            model.config.intermediate_size,
            model.config.n_heads * model.config.head_dim,
        }:
            if n % unit or n > MAX_INPUT:
                raise ValueError(
                    f"{who} with weights={weights!r} reads rows in whole blocks of {unit} weights, at most "
                    f"{MAX_INPUT} long; this model has rows of {n}"
                )


def projections(layer) -> tuple[nn.Module, ...]:
    """A decoder layer's seven projections: q, k, v, o, gate, up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def stored_weight(weight: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An ``[out, in]`` weight as the C steps read it in format ``weights`` ("fp32", "bf16", "int8"),
    and its per-row scales (int8 only, quantised by chapter 09's rule as the int8 ``decode_layout``
    quantises; else None)."""
    if weights == "int8":
        quantised = Int8RowLinear(weight)
        return quantised.q.data.contiguous(), quantised.scale.data.float().contiguous()
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    return weight.detach().to(dtype).contiguous(), None


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 blocks of an ``[out, in]`` weight: int8 values ``[out, in]`` and one fp16 scale per
    32 weights ``[out, in // 32]`` (d = max |w| / 127, q = round(w / d)). A table dequantised from Q8_0
    (the course's embedding table, which is also its output head) comes back as the file stores it."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127
    inverse = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape).contiguous(), d.to(torch.float16).contiguous()


def stored_projection(
    module: nn.Module, weights: str, group_size: int = INT4_GROUP
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A projection as the C steps read it: ``(values, scales, minima)``.

    fp32, bf16, int8: as ``stored_weight``, no minima. q4_1: a ``Q4_1Linear``'s blocks as stored
    (nibbles ``[out, blocks, 16]``, fp16 scales and minima ``[out, blocks]``). int4: chapter 09's
    ``quantize_symmetric(w, 4, group_size)``, two values a byte as ``pack_int4`` packs them
    (``[out, in // 2]``), fp32 scales ``[out, in // group_size]``."""
    if weights == "q4_1":
        return module.qs.contiguous(), module.d.contiguous(), module.m.contiguous()
    if weights == "int4":
        q, scales = quantize_symmetric(module.weight.detach(), 4, group_size)
        return pack_int4(q).contiguous(), scales.float().contiguous(), None
    return (*stored_weight(module.weight, weights), None)


def stored_head(weight: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head as a step in format ``weights`` reads it: the 4-bit steps read it in Q8_0
    (``quantize_q8_0``: the GGUF file's own format for this table), the others in their format."""
    return quantize_q8_0(weight) if weights in QUANTISED else stored_weight(weight, weights)


def head_format(weights: str) -> str:
    """The format of the output head of a step in format ``weights``."""
    return "q8_0" if weights in QUANTISED else weights


class NativeWeights:
    """A model's weights as the C steps read them, and the per-layer pointer array they take.

    Args:
        model: checked by ``check_native_model``.
        weights: ``"fp32"`` (the model's own tensors), ``"bf16"`` (a copy), ``"int8"`` (quantised
            as the int8 ``decode_layout`` quantises: int8 rows, one fp32 scale per output row),
            ``"q4_1"`` (the GGUF file's blocks as ``Q4_1Linear`` holds them) or ``"int4"``
            (chapter 09's group-wise int4, ``group_size`` weights a scale); the 4-bit formats read
            the head in Q8_0 (``stored_head``).
        keys, values: per layer, the KV tensors the step reads and writes (their pointers go in the
            array beside the layer's weights).

    ``bytes_per_step`` is what one step's weights read (an embedding row, the final norm, every
    projection and the head).
    """

    def __init__(
        self,
        model: Llama,
        weights: str,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        group_size: int = INT4_GROUP,
    ):
        library = native_library()
        config = model.config

        def stored(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            return stored_projection(module, weights, group_size)

        self.keep: list[torch.Tensor] = []  # every tensor a pointer below points into
        pointers = []
        self.bytes_per_step = config.hidden_size * 4 + model.norm.weight.nbytes  # an embedding row, the final norm
        for layer, k_cache, v_cache in zip(model.layers, keys, values, strict=True):
            attn = layer.self_attn
            q, k, v, o, gate, up, down = (stored(m) for m in projections(layer))
            tensors = [
                fp32(layer.input_layernorm.weight),
                q[0],
                k[0],
                v[0],
                fp32(attn.q_proj.bias),
                fp32(attn.k_proj.bias),
                fp32(attn.v_proj.bias),
                o[0],
                fp32(attn.o_proj.bias),
                fp32(layer.post_attention_layernorm.weight),
                gate[0],
                up[0],
                down[0],
                k_cache,
                v_cache,
                q[1],
                k[1],
                v[1],
                o[1],
                gate[1],
                up[1],
                down[1],
                *(m[2] for m in (q, k, v, o, gate, up, down)),
            ]
            kept = [t for t in tensors if t is not None]
            self.keep += kept
            pointers += [data_pointer(t) for t in tensors]
            self.bytes_per_step += sum(t.nbytes for t in kept if t is not k_cache and t is not v_cache)
        if len(pointers) != config.n_layers * library.infra_native_param_count():
            raise NativeUnavailable("the C step and this module disagree on the per-layer parameters")
        self.pointers = (ctypes.c_void_p * len(pointers))(*pointers)
        take_shared_tensors(self, model)
        self.lm_head, self.lm_head_scale = stored_head(model.lm_head.weight, weights)
        self.bytes_per_step += self.lm_head.nbytes + (0 if self.lm_head_scale is None else self.lm_head_scale.nbytes)


class NativeDecoder(StaticDecoder):
    """Greedy batch-1 decoding of ``model`` with every decode step in C (see the module's text).

    Args:
        model: an infra_lib ``Llama`` as loaded (``nn.Linear`` projections, fp32, on the CPU); for
            ``"q4_1"``, as ``load_gguf_q4_1`` loads it (the file's Q4_1 blocks in ``Q4_1Linear``).
        capacity: the most tokens (prompt and output) one call of ``greedy`` may hold.
        weights: ``"fp32"`` (the model's own weights, no copy), ``"bf16"`` (a bf16 copy of every
            projection and the output head), ``"int8"`` (each of them quantised as the int8
            ``decode_layout`` quantises: int8 weights, one scale per output row), ``"q4_1"`` (the
            file's blocks as stored) or ``"int4"`` (chapter 09's int4, ``group_size`` weights a
            scale); both 4-bit formats read the head in Q8_0, as the GGUF file stores the table.
        group_size: the int4 step's weights per scale (32, 64, 128, 256 or 512).
        library: the compiled step to call (default ``native_library()``), e.g. a profiling build.

    ``greedy`` is ``StaticDecoder.greedy``: the prompt in PyTorch, then one C call per token.
    ``bytes_per_step`` is what one step's weights read.
    """

    def __init__(
        self,
        model: Llama,
        capacity: int = 512,
        weights: str = "fp32",
        group_size: int = INT4_GROUP,
        library: ctypes.CDLL | None = None,
    ):
        check_native_model(model, weights, "NativeDecoder", group_size)
        self.library = native_library() if library is None else library
        super().__init__(model, capacity, compile=False)
        config = model.config
        self.weights = weights
        self.native = NativeWeights(model, weights, self.keys, self.values, group_size)
        self.bytes_per_step = self.native.bytes_per_step
        # the C side's dims[]: the shape, then this step's position, token and threads, then the format
        dims = [
            config.hidden_size,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
            config.n_layers,
            capacity,
            0,
            0,
            1,
            FORMAT_CODE[weights],
            group_size // BLOCK,
            FORMAT_CODE[head_format(weights)],
        ]
        if len(dims) != self.library.infra_native_dim_count():
            raise NativeUnavailable("the C step and this module disagree on the shape fields")
        self._dims = (ctypes.c_long * len(dims))(*dims)  # _step rewrites the step's three fields in place
        self._scratch = torch.empty(self.library.infra_native_scratch_floats(self._dims))
        self._logits = torch.empty(config.vocab_size)

    def _step(self, token: int, position: int) -> torch.Tensor:
        """Logits ``[vocab]`` after ``token`` at ``position``: one call into C."""
        w = self.native
        row = position * w.cos.stride(0) * w.cos.element_size()
        self._dims[_POSITION], self._dims[_TOKEN], self._dims[_THREADS] = position, token, torch.get_num_threads()
        self.library.infra_native_decode_step(
            self._dims,
            w.eps,
            w.pointers,
            w.embed.data_ptr(),
            w.final_norm.data_ptr(),
            w.lm_head.data_ptr(),
            data_pointer(w.lm_head_scale),
            w.cos.data_ptr() + row,
            w.sin.data_ptr() + row,
            self._scratch.data_ptr(),
            self._logits.data_ptr(),
        )
        return self._logits
