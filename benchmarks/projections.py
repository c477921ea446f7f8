"""Quantized projections on CPU, in one process: the model's own weights, every decoder layer's
projections and the LM head, called one after another as a forward pass calls them (so the weights
come cold from memory, not from cache), for --rows rows of random activations. Float32 (the
engine's: the packed C GEMM up to layout.PACKED_MAX_ROWS rows, MKL beyond) against each of --methods
(`mkl`: float32 in MKL's GEMM at every row count, the input-major weight; `bf16`: bfloat16
weights and activations in torch's F.linear, oneDNN's path, AMX tiles where the CPU has them;
`bf16-gemm`: the same bf16 values in spanserve's C GEMM at every row count), taking turns, best of --repeats. Beside
each time, the error of its outputs against float32's (mean |difference| over mean |float32|,
averaged over the projections): accuracy beside speed.

    spanserve bench projections [--model M] [--rows 1,8,26,64,512] [--methods mkl,bf16,bf16-gemm,int8,int4,w8a8]
"""

import argparse
import functools
import sys

from benchmarks import harness


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--rows", default="1,8,26,64,512", help="row counts")
    parser.add_argument("--methods", default="mkl,int8,int4,w8a8", help="quantizations to compare with float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/projections.json)")


def run(args: argparse.Namespace) -> dict:
    threads = harness.configure_threads(args.threads)
    import torch

    from spanserve import LLM
    from spanserve.models import quant

    llm = LLM(model=args.model, dtype="float32", num_blocks=64)
    model = llm.engine.runner.model
    linears = [p for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [model.lm_head]
    kinds = {"mkl": _Mkl, "bf16": _Bf16, "bf16-gemm": _Bf16Gemm, "int8": quant.Int8Linear,
             "int4": quant.Int4Linear, "w8a8": quant.W8A8Linear}
    methods = [m for m in args.methods.split(",") if m]
    stacks = {"float32": linears, **{m: [kinds[m](p) for p in linears] for m in methods}}
    rows = []
    with torch.no_grad():
        for count in (int(r) for r in args.rows.split(",")):
            x = {size: torch.randn(count, size) for size in {p.in_features for p in linears}}
            calls = {name: functools.partial(_forward, stack, x) for name, stack in stacks.items()}
            best = harness.best_ms_in_turns(calls, args.repeats)
            reference = [p(x[p.in_features]) for p in linears]
            errors = {m: sum(float((q(x[q.in_features]) - r).abs().mean() / r.abs().mean())
                             for q, r in zip(stacks[m], reference)) / len(linears) for m in methods}
            rows.append({"rows": count, "float32_ms": best["float32"],
                         **{f"{m}_ms": best[m] for m in methods}, **{f"{m}_error": errors[m] for m in methods}})
    result = {"benchmark": "projections", "model": args.model or "SmolLM2-135M-Instruct", "threads": threads,
              "projections": len(linears), "methods": methods, "rows": rows, "machine": harness.machine_info()}
    harness.print_table(["rows", "float32 ms", *[f"{m} ms (error)" for m in methods]],
                        [[r["rows"], f"{r['float32_ms']:.1f}",
                          *[f"{r[f'{m}_ms']:.1f} ({r['float32_ms'] / r[f'{m}_ms']:.2f}x, {r[f'{m}_error']:.4f})"
                            for m in methods]] for r in rows],
                        title=f"{len(linears)} projections of {result['model']}, {threads} threads, "
                              f"best of {args.repeats}")
    harness.write_json(result, path=args.out or harness.result_path("projections"))
    return result


class _Mkl:
    """A float32 projection in F.linear (MKL's GEMM) whatever the rows: the path before the packed GEMM."""

    def __init__(self, linear):
        from torch.nn.functional import linear as f_linear  # imported here, not in the timed call

        self.f_linear, self.linear, self.in_features = f_linear, linear, linear.in_features

    def __call__(self, x):
        return self.f_linear(x, self.linear.weight, self.linear.bias)


class _Bf16:
    """A projection in bfloat16 through F.linear (oneDNN), returning float32 like the others."""

    def __init__(self, linear):
        import torch
        from torch.nn.functional import linear as f_linear

        self.f_linear, self.in_features = f_linear, linear.in_features
        self.weight = linear.weight.detach().to(torch.bfloat16)
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def __call__(self, x):
        return self.f_linear(x.to(self.weight.dtype), self.weight, self.bias).float()


class _Bf16Gemm(_Bf16):
    """The bf16 projection in spanserve's C GEMM (layout.PackedLinear) whatever the rows."""

    def __init__(self, linear):
        from spanserve.models.layout import PACKED_MAX_ROWS, PackedLinear

        super().__init__(linear)
        bf16 = _bf16_linear(linear.in_features, linear.out_features, self.weight, self.bias)
        self.packed = PackedLinear(bf16, bf16_rows=PACKED_MAX_ROWS)

    def __call__(self, x):
        return self.packed(x.to(self.weight.dtype)).float()


def _bf16_linear(in_features: int, out_features: int, weight, bias):
    """An nn.Linear holding these bf16 tensors (built on the meta device: no weights allocated)."""
    import torch

    linear = torch.nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear


def _forward(stack: list, x: dict) -> None:
    """Every projection of `stack` once, as a forward pass calls them (x: activations by input size)."""
    for projection in stack:
        projection(x[projection.in_features])


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("projections", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
