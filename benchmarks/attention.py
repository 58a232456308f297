"""Attention without dense masks: mask memory, and context-parallel attention with and without block skipping.

1. Mask memory for packed documents: the dense boolean mask SDPA needs against the FlexAttention block
   mask of the same rule (``document_block_mask``), both built once per forward pass.
2. One context-parallel rank's attention (forward + backward), in one process (the gathered K/V are the
   whole sequence's): before, every layer built a dense ``[B, 1, S / cp, S]`` mask over all gathered keys
   and repeated K/V to all query heads; now (``ChunkMasks``, sdpa kernel) each query chunk attends only to
   the keys up to its own end, with grouped K/V heads, and the masks are built once per forward. FLOPs
   count the query-key pairs computed (4 * D per pair and head, forward).
3. On CUDA, packed-document attention forward + backward: FlexAttention (block mask) against dense-mask
   SDPA: time and peak memory.

    python benchmarks/attention.py --out benchmarks/results/attention_cpu.md
    python benchmarks/attention.py --device cuda --dtype bfloat16 --seq 8192 --cp-seq 32768 \\
        --out benchmarks/results/attention_h100.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import device_name, step_times  # noqa: E402

from titanium.debug.memory import peak_memory_bytes  # noqa: E402
from titanium.models.common.attention import document_causal_mask  # noqa: E402
from titanium.models.common.attention_kernels import document_block_mask, flex, sdpa  # noqa: E402
from titanium.parallel.context import chunk_masks, headtail_indices  # noqa: E402

MIB = 2**20


def packed(seq: int, doc_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids ``[1, seq]`` of documents of ``doc_len`` tokens (the last one shorter)."""
    index = torch.arange(seq, device=device)
    return (index % doc_len)[None], (index // doc_len)[None]


def timed(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` runs of ``step`` after one warm-up, in seconds (the least disturbed by other
    work on a shared machine)."""
    step()
    return min(step_times(step, device, repeats))


def mask_memory(seqs: list[int], doc_len: int, device: torch.device) -> list[str]:
    rows = [
        f"## 1. Mask memory, packed documents of {doc_len} tokens, batch 1 (built once per forward)",
        "",
        "| seq_len | dense bool mask MiB | block mask MiB | dense / block | blocks computed |",
        "|---:|---:|---:|---:|---:|",
    ]
    for seq in seqs:
        positions, documents = packed(seq, doc_len, device)
        dense = document_causal_mask(positions, positions, documents, documents)
        block = document_block_mask(positions, positions, documents, documents)
        parts = (block.kv_num_blocks, block.kv_indices, block.full_kv_num_blocks, block.full_kv_indices)
        parts += (block.q_num_blocks, block.q_indices, block.full_q_num_blocks, block.full_q_indices)
        block_bytes = sum(t.numel() * t.element_size() for t in parts if t is not None)
        n = block.kv_num_blocks.shape[-1]
        computed = int(block.to_dense().sum())
        rows.append(
            f"| {seq:,} | {dense.numel() / MIB:,.1f} | {block_bytes / MIB:.3f} | {dense.numel() / block_bytes:,.0f}x "
            f"| {computed} of {n * n} |"
        )
        del dense
    return rows


def cp_attention(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[str]:
    seq, cp, heads, kv_heads, head_dim = args.cp_seq, args.cp, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    q_full = torch.randn(1, seq, heads, head_dim, generator=g, device=device, dtype=dtype)
    k_full = torch.randn(1, seq, kv_heads, head_dim, generator=g, device=device, dtype=dtype)
    v_full = torch.randn_like(k_full)
    positions = torch.arange(seq, device=device)[None]
    gathered = torch.cat([headtail_indices(seq, cp, r, device) for r in range(cp)])
    rows = [
        f"## 2. One context-parallel rank's attention, forward + backward: seq_len {seq:,}, cp {cp}, "
        f"{heads} query / {kv_heads} KV heads of {head_dim}, {args.dtype}",
        "",
        "| rank | before: query-key pairs | before ms | before mask MiB per layer | after: pairs | after ms "
        "| after mask MiB per forward | pairs after / before | time after / before |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank in range(cp):
        local = headtail_indices(seq, cp, rank, device)
        q = q_full[:, local].requires_grad_()
        k, v = k_full[:, gathered].requires_grad_(), v_full[:, gathered].requires_grad_()
        rows.append(cp_rank_row(rank, cp, q, k, v, positions[:, local], positions[:, gathered], args.repeats))
    return rows


def cp_rank_row(
    rank: int,
    cp: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    repeats: int,
) -> str:
    """One table row: rank ``rank``'s queries over the gathered keys, before and after."""
    seq, rep = k.shape[1], q.shape[2] // k.shape[2]

    def before() -> None:  # the previous code: a dense mask per layer, K/V repeated to every head
        mask = (k_positions[:, None, :] <= q_positions[:, :, None]).unsqueeze(1)
        kt, vt = (t.repeat_interleave(rep, 2).transpose(1, 2) for t in (k, v))
        F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=mask).sum().backward()

    state = chunk_masks(q_positions, k_positions, None, None, cp_size=cp, cp_rank=rank, kernel="sdpa")

    def after() -> None:
        state.attend(q, k, v).sum().backward()

    t_before, t_after = timed(before, q.device, repeats), timed(after, q.device, repeats)
    assert state.masks is not None
    pairs_before = q.shape[1] * seq
    pairs_after = sum(m.shape[-2] * m.shape[-1] for m in state.masks)
    mask_after = sum(m.numel() for m in state.masks)
    return (
        f"| {rank} | {pairs_before:,} | {t_before * 1e3:,.0f} | {pairs_before / MIB:.1f} | {pairs_after:,} "
        f"| {t_after * 1e3:,.0f} | {mask_after / MIB:.1f} | {pairs_after / pairs_before:.2f} "
        f"| {t_after / t_before:.2f} |"
    )


def flex_vs_sdpa(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[str]:
    seq, heads, kv_heads, head_dim = args.seq, args.heads, args.kv_heads, args.head_dim
    positions, documents = packed(seq, args.doc_len, device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, seq, heads, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, seq, kv_heads, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, seq, kv_heads, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
    rows = [
        f"## 3. Packed-document attention, forward + backward: seq_len {seq:,}, documents of {args.doc_len}, "
        f"{heads} query / {kv_heads} KV heads of {head_dim}, {args.dtype} (mask built inside the step)",
        "",
        "| kernel | ms | peak MiB |",
        "|---|---:|---:|",
    ]

    def dense_step() -> None:
        mask = document_causal_mask(positions, positions, documents, documents)
        sdpa(q, k, v, mask).sum().backward()

    def flex_step() -> None:
        flex(q, k, v, document_block_mask(positions, positions, documents, documents)).sum().backward()

    for name, step in (("sdpa, dense mask", dense_step), ("flex, block mask", flex_step)):
        t = timed(step, device, args.repeats)
        rows.append(f"| {name} | {t * 1e3:,.1f} | {peak_memory_bytes(step, device) / MIB:,.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seq", type=int, default=8192, help="sequence length of parts 1 and 3")
    parser.add_argument("--doc-len", type=int, default=1000, help="packed document length")
    parser.add_argument("--cp-seq", type=int, default=4096, help="sequence length of part 2")
    parser.add_argument("--cp", type=int, default=4, help="context-parallel degree of part 2")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the tables here (markdown)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    command = "python " + " ".join(sys.argv)
    lines = [
        "# Attention without dense masks",
        "",
        f"Device: {device_name(device)}, torch {torch.__version__}. Command: `{command}`.",
        "",
        *mask_memory([args.seq // 4, args.seq], args.doc_len, device),
        "",
        *cp_attention(args, device, dtype),
        "",
    ]
    if device.type == "cuda":
        lines += [*flex_vs_sdpa(args, device, dtype), ""]
    else:
        lines += ["Part 3 (FlexAttention forward + backward) needs CUDA: FlexAttention has no backward on CPU.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
