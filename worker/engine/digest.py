"""The per-step digest of parameters and optimizer states, computed on the tensors' own device.

Scheme `od2` (the string starts with "od2:"; the older host-side blake2b digests have no prefix,
see `digest_scheme`). For tensors t_0..t_{k-1} (the parameter, then each state in schema order)
and element j of t_s (flattened, row-major), let x be the element's raw bits zero-extended to 64
bits (1, 2, 4 or 8 byte elements) and salt_s(j) = mix64(j * 0x9E3779B97F4A7C15 + (s + 1) *
0xC2B2AE3D27D4EB4F). Then, all arithmetic modulo 2**64:

    lane_a = sum_{s,j} x * (salt_s(j) | 1)
    lane_b = sum_{s,j} mix64(x ^ salt_s(j))
    digest = "od2:" + hex16(lane_a) + hex16(lane_b)

mix64 is the splitmix64 finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014). Why this shape:
  * integers only: every operation is exact, so the CPU, any GPU, eager code, a CUDA graph or a
    batched layout give the same bits, and sums may be reduced in any order (addition mod 2**64
    is associative), so no host round trip and no sequential hash is needed per step;
  * lane_a is linear with odd multipliers (invertible mod 2**64): a change of one element always
    changes it, with certainty; lane_b avalanches, so several changes cancelling in both lanes
    has probability about 2**-64;
  * the salt depends on the element's index and its tensor's slot, so moving or swapping values
    changes the digest.

What is digested is plain tensors. `plain_tensors` reads a state as it is (issue 37): a tensor
subclass (anything with `__tensor_flatten__`: torchao's quantized states, DTensor) is its inner
tensors in the order its `__tensor_flatten__` names them, recursively; a wrapper that is not a
tensor but has `to_local()` (DTensor-like) is its local tensor; a dict, list or tuple is its
entries in order. A plain tensor is itself, so every digest of plain tensors is what it was.

`digest_tensors` is the straightforward form (one case, one host copy of two integers per step);
worker.engine.fast computes the same lanes for many cases at once over a padded [cases, width]
layout, masking the padding, and copies them to the host once per case group.
"""

from __future__ import annotations

import torch

SCHEME = "od2"
LEGACY_SCHEME = "blake2b-128"

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_SLOT = 0xC2B2AE3D27D4EB4F
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    # Logical shift right on int64 (torch's >> is arithmetic): clear the sign-extended bits.
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor (wrapping multiplication)."""
    z = z ^ _shr(z, 30)
    z = z * _signed(_M1)
    z = z ^ _shr(z, 27)
    z = z * _signed(_M2)
    return z ^ _shr(z, 31)


def element_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of each element, zero-extended to int64, same shape."""
    size = tensor.element_size()
    if size not in _BITS_VIEW:
        raise ValueError(f"cannot digest a tensor of dtype {tensor.dtype}: elements of {size} bytes "
                         "(supported: 1, 2, 4 or 8 bytes)")
    bits = tensor.contiguous().view(_BITS_VIEW[size]).to(torch.int64)
    if size in (2, 4):
        bits = bits & ((1 << (8 * size)) - 1)
    return bits


_salt_cache: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def salts(slot: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(salt_s(j), salt_s(j) | 1) for j < length, int64 on `device`; cached."""
    key = (slot, length, str(device))
    if key not in _salt_cache:
        index = torch.arange(length, dtype=torch.int64, device=device)
        salt = mix64(index * _signed(_GOLDEN) + _signed((slot + 1) * _SLOT))
        _salt_cache[key] = (salt, salt | 1)
    return _salt_cache[key]


def lanes(bits: torch.Tensor, salt: torch.Tensor, odd_salt: torch.Tensor,
          valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (lane_a, lane_b) contributions of a [rows, width] int64 bit tensor; `valid`
    (bool, same shape) masks padding out. Reduced along the last dimension."""
    a = bits * odd_salt
    b = mix64(bits ^ salt)
    if valid is not None:
        a = a.masked_fill(~valid, 0)
        b = b.masked_fill(~valid, 0)
    return a.sum(dim=-1), b.sum(dim=-1)


def format_digest(lane_a: int, lane_b: int) -> str:
    return f"{SCHEME}:{lane_a & _MASK64:016x}{lane_b & _MASK64:016x}"


def format_digest_series(lane_a: torch.Tensor, lane_b: torch.Tensor) -> list[list[str]]:
    """`format_digest` of every element pair of two [cases, steps] int64 CPU tensors: each case's
    series. One hex conversion for the whole history instead of one f-string per digest (a
    standard battery has tens of thousands); the same strings."""
    cases, steps = lane_a.shape
    # Big-endian 64-bit words as hex are the two's-complement values masked to 64 bits, as
    # format_digest prints them: lane a's word then lane b's, 32 hex digits a step.
    words = torch.stack([lane_a, lane_b], dim=-1).numpy().astype(">i8").tobytes().hex()
    prefix = f"{SCHEME}:"
    return [[prefix + words[at:at + 32] for at in range(row * steps * 32, (row + 1) * steps * 32, 32)]
            for row in range(cases)]


def is_plain(value: object) -> bool:
    """A tensor whose elements are its own storage (torch.Tensor or nn.Parameter), not a wrapper."""
    return isinstance(value, torch.Tensor) and not hasattr(type(value), "__tensor_flatten__")


def plain_tensors(value: object, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, plain tensor) leaves of a state as it is (module doc), depth first, in order.
    Inner names join with ".": a quantized state "exp_avg" gives "exp_avg.codes", "exp_avg.scale".
    Raises TypeError for anything else (a float, None), naming where it is."""
    if is_plain(value):
        return [(name, value)]
    if isinstance(value, torch.Tensor):  # a tensor subclass: its inner tensors as it names them
        inner, _context = value.__tensor_flatten__()
        return [leaf for attr in inner for leaf in plain_tensors(getattr(value, attr), _join(name, attr))]
    if callable(getattr(value, "to_local", None)):  # a DTensor-like wrapper that is not a tensor
        return plain_tensors(value.to_local(), name)
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in plain_tensors(item, _join(name, str(key)))]
    if isinstance(value, (list, tuple)):
        return [leaf for index, item in enumerate(value) for leaf in plain_tensors(item, _join(name, str(index)))]
    raise TypeError(f"state {name or '(top)'} is a {type(value).__name__}, not a tensor, a tensor subclass, "
                    "a dict, a list or a tuple of them (expose scalars as 0-d tensors)")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def digest_lanes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The two lanes of one case as a 2-element int64 tensor on the tensors' device (no sync).
    Tensor subclasses and containers among `tensors` count as their plain leaves (plain_tensors)."""
    if not all(is_plain(t) for t in tensors):
        tensors = [leaf for _, leaf in plain_tensors(list(tensors))]
    total_a = total_b = None
    for slot, tensor in enumerate(tensors):
        bits = element_bits(tensor).reshape(-1)
        salt, odd = salts(slot, bits.numel(), bits.device)
        a, b = lanes(bits, salt, odd)
        total_a = a if total_a is None else total_a + a
        total_b = b if total_b is None else total_b + b
    return torch.stack([total_a, total_b])


def digest_tensors(tensors: list[torch.Tensor]) -> str:
    """The od2 digest of one case's tensors (parameter first, then states in schema order)."""
    lane_a, lane_b = digest_lanes(tensors).cpu().tolist()
    return format_digest(lane_a, lane_b)


def digest_scheme(digest: str) -> str:
    """The scheme a stored digest was made with: its prefix, or the legacy blake2b without one."""
    head, sep, _ = digest.partition(":")
    return head if sep else LEGACY_SCHEME
