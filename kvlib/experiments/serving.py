"""`python -m kvlib.experiments.serving`: chapter 12's serving comparison (`kvlib.engine.workload`'s
workloads and configurations) on the course model and on SmolLM2-135M-Instruct; writes one summary
row per (model, configuration) to `results/serving.csv` and the per-step trace to
`serving_steps.csv` beside it: three interleaved repeats, the median run kept.

`--recount` rewrites only the machine-independent columns of a recording (tokens computed by kind,
prefix-cache lookups, steps, blocks, preemptions), for a change to what the engine *counts*: it
reruns every run once, checks step by step that the schedule is the recorded one, and keeps the
recorded seconds (the `recounted` column dates it).
"""

from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import datetime
import os
import platform

import torch

from kvlib.engine.workload import CONFIGS, WORKLOADS, engine_for, make_workload, run_workload
from kvlib.experiments import options
from kvlib.experiments.cli import write_rows


def record(out_csv: str, repeats: int = 3) -> None:
    """Run every configuration on both models `repeats` times (interleaved rounds, so a busy
    machine slows every configuration alike); keep, per configuration, the run with the median
    busy time. Write the summaries to `out_csv` and those runs' per-step traces to
    `serving_steps.csv` in the same folder."""
    from tqdm.auto import tqdm

    from kvlib.loaders.course_model import load_course_model
    from kvlib.loaders.smollm2 import load_smollm2

    torch.manual_seed(0)
    models = {"course": load_course_model(), "smollm2": load_smollm2()[0]}
    facts = dict(
        device=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        repeats=repeats,
        date=datetime.date.today().isoformat(),
    )
    jobs = [(m, c) for m in models for c in CONFIGS]
    runs = {job: [] for job in jobs}
    with tqdm(total=repeats * len(jobs), desc="serving runs") as bar:
        for _ in range(repeats):
            for model_name, config in jobs:
                workload = WORKLOADS[model_name]
                engine = engine_for(models[model_name], workload, config)
                runs[model_name, config].append(run_workload(engine, make_workload(workload)))
                bar.update(1)
    summaries, traces = [], []
    for (model_name, config), engines in runs.items():
        engine = sorted(engines, key=lambda e: e.summary()["busy_s"])[len(engines) // 2]
        row = dict(model=model_name, config=config, num_blocks=engine.config.num_blocks)
        row.update(block_bytes=engine.block_bytes, **engine.summary(), **facts)
        summaries.append(row)
        for s in engine.stats:
            step = dataclasses.asdict(s)
            del step["scheduled"]  # the per-request plan stays out of the CSV
            traces.append(dict(model=model_name, config=config, **step))
    for path, rows in ((out_csv, summaries), (_steps_path(out_csv), traces)):
        write_rows(path, rows)


# the per-step fields that fix a schedule; a recount must find them unchanged
SCHEDULE_FIELDS = ("step", "num_running", "num_waiting", "num_blocks_in_use", "num_preemptions")
TIMED_FIELDS = ("busy_s", "output_tokens_per_s", "mean_ttft_s", "p90_ttft_s", "mean_tpot_s",
                "p90_tpot_s", "seconds", "clock")  # fmt: skip


def _rerun(job: tuple[str, str, int | None]) -> tuple[int, dict, list[dict]]:
    """One run of (model, configuration), untimed, with the model cut to its first `num_layers`
    layers if given: its number of blocks, its summary and its per-step stats."""
    from kvlib.loaders.course_model import load_course_model
    from kvlib.loaders.smollm2 import load_smollm2

    torch.set_num_threads(1)
    model_name, config, num_layers = job
    model = load_course_model() if model_name == "course" else load_smollm2()[0]
    if num_layers is not None and num_layers < model.config.num_hidden_layers:
        model.model.layers = model.model.layers[:num_layers]
        model.config = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    workload = WORKLOADS[model_name]
    engine = run_workload(engine_for(model, workload, config), make_workload(workload))
    steps = [dataclasses.asdict(s) for s in engine.stats]
    for step in steps:
        del step["scheduled"]
    return engine.config.num_blocks, engine.summary(), steps


def recount(out_csv: str, workers: int = 4, num_layers: int | None = None) -> None:
    """Rewrite the counted (machine-independent) columns of a recording made by `record`, keeping
    its timed columns: rerun each (model, configuration) once (`workers` processes), check that
    its number of blocks and every step's schedule (`SCHEDULE_FIELDS`) are the recorded ones,
    and replace every other untimed column of both files. Raises AssertionError, writing
    nothing, when a schedule differs: then the change is not a recount, and `record` must time
    the runs again.

    num_layers: run the models cut to their first `num_layers` layers (faster). Output lengths
    are fixed, so a schedule depends on the workload's lengths and the number of blocks, and the
    number of blocks at equal bytes on the ratio of block bytes, which is the same for any number
    of layers; prefix hits depend on the prompts' token ids and on each request's own freed
    blocks. The step-by-step check confirms the schedule is the recorded one."""
    with open(out_csv) as f:
        summaries = list(csv.DictReader(f))
    with open(_steps_path(out_csv)) as f:
        traces = list(csv.DictReader(f))
    jobs = [(row["model"], row["config"], num_layers) for row in summaries]
    jobs.sort(key=lambda job: job[0] == "course")  # the slow model's runs first
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        results = {job[:2]: result for job, result in zip(jobs, pool.map(_rerun, jobs))}
    today = datetime.date.today().isoformat()
    new_summaries, new_traces = [], []
    for row in summaries:
        num_blocks, summary, steps = results[row["model"], row["config"]]
        assert num_blocks == int(row["num_blocks"]), (row["model"], row["config"], "num_blocks")
        recorded = [t for t in traces if (t["model"], t["config"]) == (row["model"], row["config"])]
        assert len(recorded) == len(steps), (row["model"], row["config"], "steps")
        for old, new in zip(recorded, steps):
            for field in SCHEDULE_FIELDS:
                assert int(old[field]) == new[field], (row["model"], row["config"], field)
            timed = {k: old[k] for k in TIMED_FIELDS if k in old}
            new_traces.append(dict(model=row["model"], config=row["config"], **{**new, **timed}))
        counted = {k: v for k, v in summary.items() if k not in TIMED_FIELDS}
        for key in ("steps", "preemptions", "peak_blocks", "output_tokens", "prompt_tokens"):
            assert counted[key] == int(row[key]), (row["model"], row["config"], key)
        counted["peak_kv_bytes"] = counted["peak_blocks"] * int(row["block_bytes"])  # full model
        facts = {k: row[k] for k in ("device", "threads", "torch", "repeats", "date")}
        new_summaries.append(
            dict(
                model=row["model"],
                config=row["config"],
                num_blocks=row["num_blocks"],
                block_bytes=row["block_bytes"],
                **{k: counted.get(k, row.get(k)) for k in summary},
                **facts,
                recounted=today,
            )
        )
        for k in TIMED_FIELDS:
            if k in row:
                new_summaries[-1][k] = row[k]
    for path, rows in ((out_csv, new_summaries), (_steps_path(out_csv), new_traces)):
        write_rows(path, rows)


def _steps_path(out_csv: str) -> str:
    return os.path.join(os.path.dirname(out_csv), "serving_steps.csv")


def main(argv=None) -> None:
    parser = options.parser(
        None,  # the usage names the script's file, as before
        __doc__.split("\n")[0],
        {
            "--out": {"default": "results/serving.csv"},
            "--recount": "rewrite the counted columns of the recording in --out, keeping its "
            "timings",
            "--recount-layers": {
                "type": int,
                "default": None,
                "help": "with --recount: run the models cut to their first N layers (see recount)",
            },
        },
    )
    args = parser.parse_args(argv)
    if args.recount:
        recount(args.out, num_layers=args.recount_layers)
    else:
        record(args.out)


if __name__ == "__main__":
    raise SystemExit(main())
