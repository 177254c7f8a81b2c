"""`python -m serve` (`./run serve`): N ComfyUI workers on Ray Serve behind one ComfyUI-speaking address.

    ./run serve --workers 2                       # a local Ray on this machine, workers on the CPU
    RAY_ADDRESS=auto ./run serve --workers 8 --gpus-per-worker 1 --worker-host 0.0.0.0

Without $RAY_ADDRESS a Ray is started on this machine and stops with the command; with it, the command joins that
cluster (`ray start --head` on one machine, `ray start --address …` on the others) and the application stays
deployed there until `serve shutdown`. Extra ComfyUI flags for every worker follow `--`. docs/serve.md has the rest.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading

from .worker import WorkerSettings


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="./run serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="ComfyUI workers (Ray Serve replicas); default 2")
    ap.add_argument("--host", default="127.0.0.1", help="the ingress's address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8188, help="the ingress's port (default 8188, ComfyUI's)")
    ap.add_argument("--gpus-per-worker", type=float, default=0.0,
                    help="GPUs Ray gives each worker (default 0: the workers run with --cpu)")
    ap.add_argument("--worker-host", default="127.0.0.1",
                    help="the address each worker's ComfyUI listens on; on a cluster of several machines, one the "
                         "ingress can reach, such as 0.0.0.0 (default 127.0.0.1)")
    ap.add_argument("--workdir", default=None,
                    help="where each worker gets its own output, temp and database folder (default: a new "
                         "folder under the temporary directory, the same path on every machine)")
    ap.add_argument("--queue", type=int, default=2,
                    help="prompts one worker takes at once: one sampling, the rest read ahead (default 2)")
    ap.add_argument("--routing", choices=("files", "load", "affinity"), default="files",
                    help="files: each prompt to the worker holding most of its files, among the least loaded "
                         "(default); load: Ray's routing by the workers' queues alone; affinity: each prompt's "
                         "affinity key as its multiplexed model id (docs/serve.md compares them, measured)")
    ap.add_argument("--slack", type=int, default=0,
                    help="with --routing files: how many more prompts a worker holding more of a prompt's files may "
                         "have queued than the least loaded one and still be chosen first (default 0)")
    ap.add_argument("comfy_args", nargs="*", help="after --: ComfyUI flags for every worker")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.queue < 1 or args.slack < 0:
        ap.error("--workers and --queue are at least 1, --slack at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import ray
    from ray import serve

    from .app import build

    settings = WorkerSettings(
        workdir=args.workdir or tempfile.mkdtemp(prefix="multilora-serve-"), cpu=args.gpus_per_worker == 0,
        host=args.worker_host, args=tuple(args.comfy_args))
    if settings.cpu and not os.environ.get("RAY_ADDRESS") and "OMP_NUM_THREADS" not in settings.env:
        # CPU workers on this machine share its cores: each its share, not each all of them (two workers with
        # every core each took four times as long per prompt here as alone).
        threads = str(max(1, (os.cpu_count() or 1) // args.workers))
        settings.env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build(settings, args.workers, args.gpus_per_worker, args.queue, routing=args.routing,
                    slack=args.slack),
              name="multilora", route_prefix="/")
    print(f"[MultiLoRA] {args.workers} ComfyUI workers, routed by {args.routing}, at http://{args.host}:{args.port} "
          f"(POST /prompt, /generate; GET /history/<id>, /view, /object_info); workers' folders in "
          f"{settings.workdir}", flush=True)
    if os.environ.get("RAY_ADDRESS"):
        return 0  # deployed on the cluster: it stays until `serve shutdown`
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
