"""The `anneal` command. Subcommands import their parts lazily, so `anneal operator` and
`anneal crds` work in the torch-free operator image."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    import time

    from anneal.engine.llm import Engine, EngineArgs, resolve_device
    from anneal.engine.plan import default_plan, load_plan
    from anneal.engine.sampling_params import SamplingParams
    from anneal.engine.tokenizer import TokenizerError, load_tokenizer

    from pydantic import ValidationError

    try:  # checked before the model loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed, ignore_eos=True)
    except ValidationError as e:
        for err in e.errors():
            flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "sampling"
            print(f"anneal generate: {flag}: {err['msg']} (got {err.get('input')!r})", file=sys.stderr)
        return 2
    try:  # bad input (a missing or invalid plan or model, a plan for another device): one line, as serve does
        if args.plan:
            with open(args.plan) as f:
                plan = load_plan(f.read())
        else:
            plan = default_plan(str(resolve_device(args.device)))
        if args.tensor_parallel_size is not None:
            plan = plan.with_tensor_parallel(args.tensor_parallel_size)
        engine = Engine(EngineArgs(model=args.model, device=args.device, layers=args.layers, plan=plan))
        tok = load_tokenizer(args.model, engine.config.vocab_size, engine.config.eos_token_ids)
    except (OSError, ValueError, RuntimeError, TokenizerError) as e:
        print(f"anneal generate: {e}", file=sys.stderr)
        return 2
    prompt_ids = tok.encode(args.prompt)
    t0 = time.perf_counter()
    try:
        out = engine.generate([prompt_ids], params)[0]
    finally:
        engine.close()  # its tensor-parallel workers, if any
    dt = time.perf_counter() - t0
    print(args.prompt + tok.decode(out))
    print(f"[{engine.config.name} on {engine.device}: {len(out)} tokens in {dt:.2f} s, "
          f"{len(out) / dt:.1f} tokens/s, plan {engine.plan.hash}]", file=sys.stderr)
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="random:tiny", help="HF model folder or random:<preset>")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--layers", type=int, default=None, help="load only the first k layers")
    p.add_argument("--plan", default=None, help="a Plan or CompiledPlan JSON/YAML file (default: the device's "
                   "default plan, see anneal serve --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anneal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline (one prompt)")
    _add_engine_args(g)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, choices=range(1, 9), metavar="N",
                   help="GPUs the model is split across, one process each (default: the plan's, 1)")
    g.add_argument("--prompt", default="Anneal keeps the forward pass fast because")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)

    try:
        from anneal.engine.server import add_serve_args, run_serve

        s = sub.add_parser("serve", help="the OpenAI-compatible server (+ admin API, /metrics)")
        add_serve_args(s)
        s.set_defaults(func=run_serve)
    except ImportError as e:  # torch-free image
        _unavailable(sub, "serve", e)

    try:
        from anneal.agents.compile import add_compile_args, run_compile

        c = sub.add_parser("compile", help="search for a faster, verified plan")
        add_compile_args(c)
        c.set_defaults(func=run_compile)
    except ImportError as e:
        _unavailable(sub, "compile", e)

    try:
        from anneal.operator.main import add_operator_args, run_operator, run_crds

        o = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
        add_operator_args(o)
        o.set_defaults(func=run_operator)
        cr = sub.add_parser("crds", help="print the CRD YAML generated from the API models")
        cr.set_defaults(func=run_crds)
    except ImportError as e:
        _unavailable(sub, "operator", e)
        _unavailable(sub, "crds", e)
    return parser


def _unavailable(sub, name: str, err: Exception) -> None:
    p = sub.add_parser(name, help=f"(unavailable: {err})")

    def fail(_args: argparse.Namespace) -> int:
        print(f"anneal {name} is unavailable in this installation: {err}", file=sys.stderr)
        return 2

    p.set_defaults(func=fail)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ImportError as e:  # e.g. `anneal serve` in the torch-free operator image
        print(f"anneal {args.command} is unavailable in this installation: {e} "
              "(install the engine extra: pip install 'anneal[engine]')", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
