"""`pdtb chaos`: launch or attach, plan, load and faults, the quiet check, processes left, the
report.

`pdtb chaos`: a fault campaign against a cluster under a steady greedy load of several
tenants, checked by an independent checker (pdtb/chaos/checker.py).

    pdtb chaos --duration S --seed N [--faults LIST] [--every MIN,MAX]
               (--launch "ARGS for launch_cluster.sh" [--run-dir D] | --url URL --run-dir D)
               --report FILE [--tenants T] [--workers W] [--max-tokens MIN,MAX] [--prompt-len MIN,MAX]
    pdtb chaos --router-drill N --seed N (--launch ... | --url ... --run-dir D) --report FILE

--launch starts the cluster with launch_cluster.sh ARGS --restart-failed, the router with
--allow-fault-injection, and stops it at the end (then no process of it may be left). A cluster
given by --url and --run-dir must have been launched so (its run dir has supervisor.pid).

Faults come from the seed alone (pdtb/chaos/plan.py): the schedule is printed before the run and
kept in the report, so a failing run is replayed with the same flags. Once the load stops, the
cluster must go quiet: every healthy node holds no page, runs and queues nothing. The report
(JSON): the command and seed, the schedule and what came of each fault, `faults` by kind,
`outcomes` by kind, each node process's RSS growth, and `violations`, each with its request's
timeline. The exit status is 1 on any violation.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
import urllib.error

from pdtb.common import CliError

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUIET_S = 90.0  # once the load stops, the cluster is quiet within this bound
RSS_EVERY_S = 5.0
RSS_SETTLE_S = 30.0  # a node process's RSS is compared from this long after its first sample
RSS_GROWTH_MAX = 1.10
KILLS = ("kill-prefill", "kill-decode", "drain", "router-kill")  # kinds that need a supervisor to restart


def pair(text: str, kind=float) -> tuple:
    try:
        a, b = (kind(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want MIN,MAX, got {text!r}") from None
    if not 0 <= a <= b:
        raise argparse.ArgumentTypeError(f"want 0 <= MIN <= MAX, got {text!r}")
    return a, b


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdtb chaos", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, metavar="S", help="seconds of load and faults (a campaign)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--faults", default="all", help="comma-separated kinds (pdtb/chaos/plan.py), or all")
    ap.add_argument("--every", type=pair, default=(10.0, 20.0), metavar="MIN,MAX", help="seconds between faults")
    ap.add_argument("--launch", metavar="ARGS", help="launch_cluster.sh arguments of a cluster to start and stop")
    ap.add_argument("--url", help="the router of a running cluster (with --run-dir)")
    ap.add_argument("--run-dir", help="the cluster's run dir (with --launch: where to start it)")
    ap.add_argument("--report", required=True, metavar="FILE")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--workers", type=int, default=3, help="streams each tenant keeps going")
    ap.add_argument("--max-tokens", type=lambda t: pair(t, int), default=(8, 128), metavar="MIN,MAX")
    ap.add_argument("--prompt-len", type=lambda t: pair(t, int), default=(16, 160), metavar="MIN,MAX")
    ap.add_argument("--prompts", type=int, default=48, help="distinct prompts in the pool")
    ap.add_argument("--router-drill", type=int, default=0, metavar="N",
                    help="instead of a campaign: N streams in flight, the router killed; seconds until every node "
                         "holds no page, until the router is back, and its completions against generate")
    a = ap.parse_args(argv)
    if (a.launch is None) == (a.url is None):
        raise CliError("give either --launch ARGS or --url URL with --run-dir DIR")
    if a.url and not a.run_dir:
        raise CliError("--url needs --run-dir: the cluster's processes are found there")
    if a.router_drill < 0 or not a.router_drill and (a.duration is None or a.duration <= 0):
        raise CliError("give --duration S (seconds, positive) for a campaign, or --router-drill N")
    if a.tenants < 1 or a.workers < 1 or a.prompts < 1 or a.max_tokens[0] < 1:
        raise CliError("--tenants, --workers, --prompts and --max-tokens must be positive")
    return a


def launch(args: str, run_dir: pathlib.Path) -> str:
    words = shlex.split(args)
    if "--router-args" in words:
        i = words.index("--router-args") + 1
        words[i] += " --allow-fault-injection"
    else:
        words += ["--router-args", "--allow-fault-injection"]
    i = words.index("--") if "--" in words else len(words)  # (launch_cluster.sh's flags before the nodes' extras)
    words[i:i] = ["--restart-failed", "--run-dir", str(run_dir), "--port", "0"]
    r = subprocess.run(["bash", str(ROOT / "scripts/launch_cluster.sh"), *words], capture_output=True, text=True)
    ready = [ln for ln in r.stdout.splitlines() if ln.startswith("READY ")]
    if r.returncode != 0 or not ready:
        raise CliError(f"the cluster did not start:\n{r.stderr[-3000:]}")
    return ready[0].split()[1]


def stop(run_dir: pathlib.Path) -> str:
    r = subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "--run-dir", str(run_dir), "--timeout", "30"],
                       capture_output=True, text=True, timeout=180)
    return (r.stdout + r.stderr).strip()


def left_behind(run_dir: pathlib.Path) -> list[dict]:
    """Processes started for this run dir (launch_cluster.sh puts PDTB_RUN_DIR in their
    environment) that still run."""
    import psutil

    from pdtb.chaos.inject import ours

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and ours(p.info["pid"], run_dir):
                out.append({"pid": p.info["pid"], "cmdline": " ".join(p.info["cmdline"] or [])[:300]})
        except psutil.Error:
            pass
    return out


def shape(run_dir: pathlib.Path) -> tuple[list[str], list[str], str]:
    from pdtb.local_cluster.supervise import read_argv

    names = sorted(p.stem for p in run_dir.glob("*.argv"))
    argv = read_argv(run_dir / "router-0.argv")
    model = argv[argv.index("--model") + 1]
    return [n for n in names if n.startswith("prefill-")], [n for n in names if n.startswith("decode-")], model


async def sample_rss(run_dir: pathlib.Path, t0: float, stop: asyncio.Event, out: dict) -> None:
    import psutil

    while not stop.is_set():
        for pid_file in run_dir.glob("*-*.pid"):
            if pid_file.stem.startswith("router"):
                continue
            try:
                pid = int(pid_file.read_text())
                out.setdefault(f"{pid_file.stem} pid {pid}", []).append(
                    (time.monotonic() - t0, psutil.Process(pid).memory_info().rss))
            except (ValueError, OSError, psutil.Error):
                pass
        try:
            await asyncio.wait_for(stop.wait(), RSS_EVERY_S)
        except asyncio.TimeoutError:
            pass


def _health(url: str) -> dict:
    """The router's /health body, a 503's included (the nodes it misses)."""
    from pdtb.chaos.inject import http_json

    try:
        return http_json(f"{url}/health", timeout=5)
    except urllib.error.HTTPError as e:
        try:
            return json.loads(e.read() or b"{}")
        except ValueError:
            return {"error": f"HTTP {e.code}"}
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def healthy_but_ended(health: dict, cluster: list[dict], ended: set[str]) -> bool:
    """The router is healthy, or every node it misses is one the campaign ended on purpose and
    that does not come back (a torch-transport node cannot rejoin its group: docs/faults.md)."""
    if health.get("status") == "ok":
        return True
    if health.get("status") != "unhealthy" or not health.get("missing"):
        return False
    gone = {n["address"] for n in cluster if n["id"].split("~")[0] in ended}
    return all(m.get("address") in gone for m in health["missing"])


def quiet(url: str, run_dir: pathlib.Path, ended: set[str] = frozenset()) -> dict:
    """Wait (bounded) until the router is healthy, but for the nodes in `ended` (ended on purpose
    and not restarted), and every node it lists healthy holds no page and runs and queues
    nothing; what was seen last."""
    from pdtb.chaos.checker import holds_nothing
    from pdtb.chaos.inject import http_json

    t = time.monotonic()
    last: list = []
    health: dict = {}
    while time.monotonic() - t < QUIET_S:
        health = _health(url)
        try:
            cluster = http_json(f"{url}/cluster")
        except (OSError, ValueError):
            cluster = []
        last = [n for n in cluster if n["healthy"]]
        if healthy_but_ended(health, cluster, ended) and holds_nothing(last):
            return {"quiet": True, "seconds": round(time.monotonic() - t, 1), "nodes": [n["id"] for n in last],
                    **({"ended": sorted(ended)} if ended else {})}
        time.sleep(0.5)
    return {"quiet": False, "health": health, "nodes": [
        {k: n[k] for k in ("id", "pages_free", "pages_total", "host_pages_free", "host_pages_total", "running",
                           "waiting")} for n in last]}


async def campaign(a, url: str, run_dir: pathlib.Path, faults, prompts) -> dict:
    from pdtb.chaos.inject import Injector
    from pdtb.chaos.load import END_S, RETRY_FOR_S, Load

    t0 = time.monotonic()
    load = Load(url, prompts, seed=a.seed, tenants=a.tenants, workers=a.workers, max_tokens=a.max_tokens, t0=t0)
    inj = Injector(url, run_dir, load, a.seed)
    rss: dict = {}
    tasks = [asyncio.create_task(load.run()), asyncio.create_task(inj.run(faults)),
             asyncio.create_task(sample_rss(run_dir, t0, load.stop, rss))]
    try:
        await asyncio.wait_for(asyncio.shield(load.stop.wait()), a.duration)
    except asyncio.TimeoutError:
        pass
    load.stop.set()
    print(f"chaos {load.now():8.1f}s load stops: waiting for the requests in flight", flush=True)
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), END_S + RETRY_FOR_S + 10)
    finally:
        inj.resume_all()
    return {"requests": load.requests, "faults": inj.log, "router_kills": inj.router_kills, "rss": rss,
            "ended": set(inj.ended)}


def router_drill(a, argv: list[str], url: str, run_dir: pathlib.Path) -> int:
    from pdtb.chaos.drill import drill

    try:
        report = drill(url, run_dir, a.router_drill, a.seed, shape(run_dir)[2])
    except RuntimeError as e:
        report = {"violations": [str(e)]}
    finally:
        stopped = stop(run_dir) if a.launch is not None else ""
    left = left_behind(run_dir) if a.launch is not None else []
    report["violations"] += [f"left behind: {p}" for p in left]
    report = {"command": "pdtb chaos " + " ".join(shlex.quote(x) for x in argv), **report, "stop": stopped}
    pathlib.Path(a.report).write_text(json.dumps(report, indent=1) + "\n")
    print("chaos: router drill " + json.dumps({k: v for k, v in report.items() if k not in ("command", "stop")}),
          flush=True)
    return 1 if report["violations"] else 0


def main(argv: list[str]) -> int:
    from pdtb.chaos.checker import reference, rss_growth, verdicts
    from pdtb.chaos.inject import http_json
    from pdtb.chaos.load import prompt_pool
    from pdtb.chaos.plan import parse_kinds, plan

    a = parse(argv)
    try:
        kinds = parse_kinds(a.faults)
    except ValueError as e:
        raise CliError(str(e)) from None
    run_dir = pathlib.Path(a.run_dir or ROOT / f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}").resolve()
    if a.launch is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"chaos: launching the cluster in {run_dir}", flush=True)
        url = launch(a.launch, run_dir)
    else:
        url = a.url.rstrip("/")
        if set(kinds) & set(KILLS) and not (run_dir / "supervisor.pid").exists():
            raise CliError(f"{run_dir} has no supervisor.pid: a killed process would stay dead "
                           "(launch_cluster.sh --restart-failed), or leave out " + ", ".join(KILLS))
    if a.router_drill:
        return router_drill(a, argv, url, run_dir)
    try:
        prefill, decode, model = shape(run_dir)
        faults = plan(a.seed, a.duration, a.every, kinds, prefill, decode)
        print(f"chaos: seed {a.seed}, {len(faults)} fault(s) over {a.duration:.0f} s:", flush=True)
        for f in faults:
            print(f"  {f.at_s:8.1f}s {f.kind:15s} {f.target:11s} {f.param:g}", flush=True)
        vocab = http_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        prompts = prompt_pool(a.seed, vocab, a.prompts, a.prompt_len)
        got = asyncio.run(campaign(a, url, run_dir, faults, prompts))
        print("chaos: waiting for the cluster to go quiet", flush=True)
        calm = quiet(url, run_dir, got["ended"])
    finally:
        stopped = stop(run_dir) if a.launch is not None else ""
    left = left_behind(run_dir) if a.launch is not None else []
    print("chaos: computing the reference with transformers.generate", flush=True)
    ref = reference(model, prompts, a.max_tokens[1])
    outcomes, violations = verdicts(got["requests"], ref, got["router_kills"], got["faults"])
    growth = rss_growth(got["rss"], RSS_SETTLE_S)
    if not calm["quiet"]:
        violations.append({"kind": "not quiet", "what": "pages held or work left once the load stopped", **calm})
    if left:
        violations.append({"kind": "left behind", "what": f"{len(left)} process(es) after the stop", "processes": left})
    violations += [{"kind": "memory", "what": f"{k}: RSS grew {v['growth']:.3f}x", **v}
                   for k, v in growth.items() if v["growth"] > RSS_GROWTH_MAX]
    by_kind: dict[str, int] = {}
    for f in got["faults"]:
        if not f["result"].startswith("skipped"):
            by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    report = {"command": "pdtb chaos " + " ".join(shlex.quote(x) for x in argv), "seed": a.seed,
              "duration_s": a.duration, "run_dir": str(run_dir), "faults": by_kind, "outcomes": outcomes,
              "violations": violations, "schedule": got["faults"], "quiet": calm, "rss": growth,
              "stop": stopped, "requests": len(got["requests"])}
    pathlib.Path(a.report).write_text(json.dumps(report, indent=1) + "\n")
    print(f"chaos: {len(got['requests'])} requests; faults {json.dumps(by_kind)}; outcomes {json.dumps(outcomes)}; "
          f"max RSS growth {max((v['growth'] for v in growth.values()), default=1.0):.3f}x; "
          f"{len(violations)} violation(s); report {a.report}", flush=True)
    for v in violations[:10]:
        print(f"  violation {v['kind']}: {v['what']}", file=sys.stderr)
    return 1 if violations else 0
