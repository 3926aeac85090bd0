"""``lmlab run MANIFEST``: trains every variant into ``runs/<name>/<variant>/``.

Running it again continues the sweep (completed variants are skipped, interrupted ones resume); a
variant that fails is recorded as failed, with its error, and the others still run. Every variant is
checked before any trains (:mod:`lmlab.checks`): one that could not run refuses the whole command.
``--executor NAME`` hands the variants to an executor plugin (a Dask cluster, a SLURM array:
:mod:`lmlab.train.executors`); ``--status`` prints where each variant stands and trains nothing.
"""

import contextlib
import sys
from pathlib import Path

from lmlab import manifest
from lmlab.errors import UserError, warn
from lmlab.train import sweep
from lmlab.train.lock import describe


def add_arguments(parser) -> None:
    parser.add_argument("manifest", help="path to a TOML manifest")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a manifest value (repeatable), e.g. --set train.max_steps=100")
    parser.add_argument("--out", type=Path, help="runs folder (default: runs/<name>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue interrupted variants and skip completed ones (what a second run does "
                             "anyway; kept for scripts that say so)")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete what the variants' folders hold and train them from scratch")
    parser.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                        help="train N variants at once, in child processes sharing the CPU threads")
    parser.add_argument("--only", action="append", default=[], metavar="VARIANT",
                        help="train only this variant of the sweep (repeatable), e.g. for one job of a "
                             "cluster array")
    parser.add_argument("--executor", default="local", metavar="NAME",
                        help="where the variants run: local (this machine, default), dask (a Dask cluster, "
                             "lmlab-dask), slurm (a SLURM array, lmlab-slurm), or another executor plugin")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="with --executor dask: a running scheduler (tcp://host:8786); default: a local "
                             "cluster of --jobs worker processes")
    parser.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                        help="with --executor slurm: a job setting (repeatable), e.g. partition=gpu, "
                             "timeout_min=240; see the lmlab-slurm README")
    parser.add_argument("--status", action="store_true",
                        help="print each variant's state (and where its executor runs it); train nothing")


def main(args) -> int:
    if args.jobs < 1:
        raise UserError("must be at least 1", key="--jobs")
    if args.overwrite and args.resume:
        raise UserError("--overwrite and --resume contradict each other", key="--overwrite")
    from lmlab.train import executors

    # The executor and its options before the manifest is read: an executor that is not installed,
    # a wrong option, an unreachable scheduler start nothing.
    executor = None if args.status else executors.load(args.executor, args.scheduler, args.slurm)
    variants = manifest.load(args.manifest, args.overrides)
    out = args.out or Path("runs") / variants[0].experiment
    if args.status:
        print("\n".join(executors.status_lines(_select(variants, args.only), out)))
        return 0
    main_process = sweep.is_main_process()
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if main_process else (lambda text: None)
    selected = _select(variants, args.only)
    from lmlab import checks

    # A variant that cannot run is bad input, before any other trains.
    checked = checks.run_all(selected, machine=executor is None)
    sweep.check_out(out)
    # Bad input found only once a variant reads its data (too little of it for one window) refuses
    # the command after the sweep index went in: put the runs folder back as it was.
    with sweep.undone_on_refusal(out, main_process):
        failed, planned = _run_all(args, variants, selected, out, checked, main_process, say, executor)
    return _finish(variants, planned, failed, main_process, say)


def _run_all(args, variants, selected, out, checked, main_process, say, executor) -> tuple[list, list]:
    """Plan, claim and train the selected variants: (those that did not complete, the plan)."""
    with contextlib.ExitStack() as held:
        locks = {}
        if main_process:
            # Every variant's folder is claimed before it is even looked at, and held until the end:
            # a second live run into any of them is refused here, and what the plan reads cannot
            # change under it.
            locks = sweep.claim([out / v.name for v in selected], held)
            for lock in locks.values():
                if lock.took_over:
                    say(f"note: {lock.run_dir}: taking over the lock of a run that is no longer alive "
                        f"({describe(lock.took_over)})")
        # Other ranks of a distributed run re-run this command after the main process has planned and
        # started writing: they must not delete anything, and they follow the same plan.
        planned = sweep.plan(selected, out, overwrite=args.overwrite and main_process)
        todo = [item for item in planned if item.action != "skip"]
        if main_process:
            if not args.only:
                sweep.write_index(out, args.manifest, args.overrides, variants)
            if args.overwrite:
                for item in planned:
                    sweep.clear(item.run_dir)
        for note in dict.fromkeys(n for item in planned for n in item.variant.notes):
            say(f"note: {note}")
        for item in planned:
            if item.action == "skip":
                say(f"[{item.variant.name}] already completed; skipped")

        if executor is not None and todo:
            from lmlab.train import executors

            # Each job takes its own folder's lock wherever it runs: release ours first.
            held.close()
            base = executors.absolute_argv(args.manifest, out, args.overrides)
            results, running = executors.run(executor, args.executor, todo, args.jobs if args.jobs > 1 else None,
                                             base, out, say)
            failed = [item for item in todo if item.variant.name not in running
                      and (results.get(item.variant.name) or {}).get("status") != "completed"]
        elif args.jobs > 1 and len(todo) > 1:
            base = ["run", str(args.manifest), "--out", str(out), *(f"--set={o}" for o in args.overrides)]
            results = sweep.run_parallel(todo, args.jobs, base, say, {item.variant.name: locks[item.run_dir]
                                                                       for item in todo if item.run_dir in locks})
            failed = [item for item in todo if (results.get(item.variant.name) or {}).get("status") != "completed"]
        else:
            failed = _run_here(todo, say, checked)
    return failed, planned


def _finish(variants, planned, failed, main_process, say) -> int:
    if main_process:
        _closing_note(variants[0], [item.run_dir for item in planned], say)
        if failed:
            recorded = [item for item in failed if (item.run_dir / "summary.json").is_file()]
            where = ("; the error of each is in summary.json (and the traceback in error.log) of its folder"
                     if len(recorded) == len(failed) else
                     f" ({', '.join(item.variant.name for item in failed if item not in recorded)} never started, "
                     "so no folder records it)")
            say(f"{len(failed)} of {len(planned)} variant(s) did not complete{where}. Running the same command "
                "again retries them.")
    return 1 if failed else 0


def _select(variants: list, only: list[str]) -> list:
    if not only:
        return variants
    by_name = {v.name: v for v in variants}
    for name in only:
        if name not in by_name:
            from lmlab.errors import did_you_mean

            raise UserError(f"the manifest has no variant {name!r}{did_you_mean(name, list(by_name))}; "
                            f"it has: {', '.join(by_name)}", key="--only")
    return [by_name[name] for name in dict.fromkeys(only)]


def _run_here(todo: list, say, checked: dict) -> list:
    """Train the variants one after another in this process; returns those that did not complete."""
    from lmlab.train.runner import run_variant

    failed = []
    for i, item in enumerate(todo, 1):
        variant, run_dir = item.variant, item.run_dir
        say(f"[{i}/{len(todo)}] {variant.name} → {run_dir}" + {"resume": " (resuming)",
            "restart": f" (starting over: {item.reason})"}.get(item.action, ""))
        if item.action == "restart" and sweep.is_main_process():
            sweep.clear(run_dir)
        try:
            result = run_variant(variant, run_dir, resume=item.action == "resume", checked=checked[variant.name])
        except UserError as exc:
            # Bad input the checks could not see (it needs the prepared data): exit 2 like any other,
            # rather than a failure of one variant; those already trained are kept, and running the
            # command again after the fix skips them.
            if len(todo) == 1:
                raise
            raise UserError(f"{exc.message} (variant {variant.name})", key=exc.key) from None
        except Exception as exc:  # recorded in the variant's summary.json and error.log by the runner
            failed.append(item)
            say(f"[{variant.name}] failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            _say_diagnosis(run_dir, say)
            continue
        s = result.summary
        if not result.is_main:
            continue
        if s["status"] != "completed":
            failed.append(item)
            continue
        ppl = f" (ppl {s['val_ppl']:.2f})" if s.get("val_ppl") is not None else ""
        print(f"[{variant.name}] val_loss {s['val_loss']:.4f}{ppl} | "
              f"{s['tokens_per_s'] or 0:,.0f} tokens/s | {s['wall_s']:.0f}s | {s['params']:,} params", flush=True)
        _closing_sample(variant, result)
    return failed


def _say_diagnosis(run_dir, say) -> None:
    """The failed run's diagnosis (summary.json), under its one-line error."""
    import json

    from lmlab.diagnose import render

    try:
        diagnosis = json.loads((run_dir / "summary.json").read_text()).get("diagnosis")
    except (OSError, ValueError):
        return
    if diagnosis:
        say(render(diagnosis))
        say(f"(lmlab doctor {run_dir} prints this again, with the run's health)")


def _closing_sample(variant, result) -> None:
    """A few tokens from the trained model; a failure here is reported and never fails the run."""
    from lmlab.sampling import generate_text

    cfg = variant.train
    if not cfg.sample_tokens or not result.plugins["objective"].causal:  # a bidirectional model cannot generate
        return
    try:
        from types import SimpleNamespace

        from lmlab.generation.runs import prepare_decoder

        decoder = result.plugins["decoding"]
        prepare_decoder(decoder, SimpleNamespace(model=result.module.model, tokenizer=result.tokens.tokenizer))
        text = generate_text(result.module.model, result.tokens.tokenizer, decoder,
                             cfg.sample_prompt, cfg.sample_tokens, seed=variant.seed)
    except Exception as exc:
        warn(f"[{variant.name}] the closing sample failed ({type(exc).__name__}: {exc}); the run itself completed")
        return
    print(f"--- sample ({variant.slots['decoding'].name}) ---\n{cfg.sample_prompt}{text}\n---", flush=True)


def _closing_note(variant, run_dirs: list[Path], say) -> None:
    """What the tracker has to say after the sweep (e.g. the `wandb sync` command for offline runs)."""
    note = variant.instantiate("tracker").closing_note(run_dirs)
    if note:
        say(note)
