"""The engine's torch operations, with llama.cpp's CPU semantics where they change a value.

The spec is the NumPy runtime's (kimi_convert/runtime/forward.py, llama.cpp's graph); this is the same math on
torch tensors, batched over chunks, in float32. One thing is kept from ggml on purpose: before a weight
product, ggml converts the f32 activation to the weight type's vec_dot type (bf16 for BF16 weights, Q8_0 for
the 32-blocks and MXFP4, Q8_K for the K- and i-quants; ggml-cpu.c's type traits). Without it the activations of
a BF16 or MXFP4 model drift from llama.cpp's layer by layer; with it only the summation order differs.
`vec_dot_round` is that conversion (x86 rules, as the pinned llama-cpp-python runs them:
kimi_convert/runtime/ggml_cpu.py's `vec_dot_input`, which the tests compare it with).
"""
from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType as QT

F32 = torch.float32
QK8_0, QK_K = 32, 256
_Q8_0_DOT = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.MXFP4, QT.IQ4_NL, QT.TQ1_0, QT.TQ2_0}
_Q8_K_DOT = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS, QT.IQ1_S, QT.IQ1_M, QT.IQ2_XXS,
             QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S}


def vec_dot_round(x: torch.Tensor, weight_type: QT) -> torch.Tensor:
    """x [..., K] as the values ggml's mul_mat multiplies against a weight of this type."""
    if weight_type == QT.BF16:
        return x.to(torch.bfloat16).to(F32)
    if weight_type == QT.F16:
        return x.to(torch.float16).to(F32)
    if weight_type in _Q8_0_DOT:
        return _q8_0(x)
    if weight_type in _Q8_K_DOT:
        return _q8_k(x)
    return x


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0 (x86): d = fp16(max|x| / 127), q = round-half-even(x * 127/max|x|)."""
    b = x.reshape(*x.shape[:-1], -1, QK8_0)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax == 0, torch.zeros_like(amax), _div(127.0, amax))
    d = (amax / 127.0).to(torch.float16).to(F32)
    return (torch.round(b * inv) * d).reshape(x.shape)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_K_ref: iscale = -127 / (the first element of largest magnitude), q <= 127, d = 1/iscale."""
    b = x.reshape(*x.shape[:-1], -1, QK_K)
    amax = b.abs().amax(-1, keepdim=True)
    extreme = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
    zero = amax == 0
    iscale = torch.where(zero, torch.zeros_like(amax), _div(-127.0, torch.where(zero, torch.ones_like(extreme), extreme)))
    d = torch.where(zero, torch.zeros_like(amax), _div(1.0, torch.where(zero, torch.ones_like(iscale), iscale)))
    q = torch.clamp(torch.round(b * iscale), max=127)
    return (q.double() * d.double()).to(F32).reshape(x.shape)        # the value q x d, rounded once


def _div(a: float, t: torch.Tensor) -> torch.Tensor:
    """a / t correctly rounded: torch computes `scalar / tensor` as scalar * (1 / tensor), one rounding more."""
    return torch.full_like(t, a) / t


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis. ggml sums the squares in double; torch's blocked float32
    reduction is within ~1e-7 of it, and a widening to double would cost a third of a K3 layer's time."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xc = x - x.mean(-1, keepdim=True)
    return xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps); llama.cpp builds it as rms_norm(x, eps/n) / sqrt(n)."""
    n = x.shape[-1]
    return rms_norm(x, eps / n) * (1 / math.sqrt(n))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """ggml_softplus: log(1 + exp(x)), and x itself above 20."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU: beta tanh(g/beta) sigma(g) * U, with U = lb tanh(u/lb) when lb > 0."""
    a = torch.tanh(g * (1 / beta)) * beta * torch.sigmoid(g)
    if linear_beta > 0:
        u = torch.tanh(u * (1 / linear_beta)) * linear_beta
    return a * u
