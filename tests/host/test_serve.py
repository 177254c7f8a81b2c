"""The serving application (serve/): two CPU ComfyUI workers on a local Ray Serve, behind the ComfyUI-speaking ingress.

What is claimed, and against what:
- a prompt through the ingress gives the image the same prompt gives straight to one ComfyUI (the host tier's
  session server, its models unloaded first, as a fresh worker's are): bit for bit, unless the host itself does not
  repeat an image in this run; then within 3× what the same prompt moves between two direct runs;
- two stacks sent in turn stay on one worker each, each file is read once, and by the worker its stack went to only
  (a worker given neither reads neither): counted from each worker's own /multilora/status (its cache's misses and
  entries) and /multilora/resident, not inferred from times;
- ComfyUI's own answers come through unchanged: a prompt it refuses (an unknown node, a LoRA outside the loras
  folders) gets its status and error, an unknown prompt id a 404;
- a worker whose ComfyUI is killed while it samples gives that prompt an error within a bounded time, Ray starts a
  new worker, and a prompt sent while the other worker is busy is served by it (the router sends a prompt to the
  least loaded worker first, serve/ranking.py).
"""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tools import comfy_server as cs

from .support import workflows as wf

pytestmark = pytest.mark.host

STYLE, CHARACTER, DETAIL = (wf.NAMES[n] for n in ("style.safetensors", "character.safetensors", "detail.safetensors"))
STACK_A = [(STYLE, 0.8)]
STACK_B = [(CHARACTER, 0.6), (DETAIL, 0.9)]
STACK_KILLED = [(CHARACTER, 0.7)]
ERROR_WITHIN_S = 30.0  # from the kill to the prompt's error in /history
NEW_WORKER_WITHIN_S = 240.0  # for Ray to notice, start a new replica and its ComfyUI


def stack_prompt(stack, seed: int = 7, steps: int = 2) -> dict:
    p = wf.model_graph(wf.loader_nodes(stack, ["1", 0]), ["ml", 0], seed=seed, prefix="serve")
    p["8"]["inputs"]["steps"] = steps
    return p


def http(url: str, body: dict | None = None, timeout: float = 600.0) -> tuple[int, object]:
    """(status, answer) of a request to the ingress or a worker: `/generate` waits for the image, hence the timeout."""
    return cs.fetch(url, body, timeout)


def png(b64: str) -> np.ndarray:
    from PIL import Image
    with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
        return np.array(im.convert("RGB"), dtype=np.uint8)


def mad(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def workers(workdir: Path) -> dict[str, str]:
    """{replica id: its ComfyUI's address}, from the folders the replicas made, stopped ones included."""
    return {d.name: (d / "url").read_text().strip() for d in workdir.iterdir() if (d / "url").is_file()}


def live_workers(workdir: Path) -> dict[str, str]:
    out = {}
    for name, url in workers(workdir).items():
        try:
            http(url + "/system_stats", timeout=10)
            out[name] = url
        except OSError:
            pass  # a worker Ray has replaced
    return out


def reads(url: str) -> tuple[int, set[str]]:
    """A worker's LoRA files read so far (its cache's misses) and the names its cache holds."""
    _, status = http(url + "/multilora/status")
    return status["cache"]["misses"], {e["name"] for e in status["cache"]["entries"]}


@pytest.fixture(scope="module")
def direct(server):
    """What one ComfyUI gives straight, from a fresh state each time, read before the workers start; then the
    session server's models are unloaded, so that two workers are the only ComfyUI holding models."""
    example = wf.small(wf.load("multilora_api.json"), prefix="direct")
    images = []
    for _ in range(2):
        server.free()
        images.append(server.run(example)[0])
    refusals = {}
    for name, prompt in refused_prompts().items():
        try:
            server.post_prompt(prompt)
        except cs.ComfyPromptError as e:
            refusals[name] = e.response
    server.free()
    return {"example": example, "images": images, "refusals": refusals}


def refused_prompts() -> dict:
    outside = stack_prompt(STACK_A)
    outside["s0"]["inputs"]["lora_name"] = "../" + STYLE
    return {"unknown_node": {"1": {"class_type": "NoSuchNode", "inputs": {}}}, "outside_loras": outside}


@pytest.fixture(scope="module")
def ingress(direct, comfy_root, comfy_python, models_dir, tmp_path_factory):
    ray = pytest.importorskip("ray", reason="serving tests skipped: ray[serve] is not installed (./run test "
                                            "installs it; pip install -e '.[serve]')")
    from ray import serve

    from serve.app import build
    from serve.worker import WorkerSettings, launch_env

    work = tmp_path_factory.mktemp("serve")
    flags, env = cs.ComfyServer(comfy_root=comfy_root, python=comfy_python, models_dir=models_dir,
                                workdir=work / "flags").worker_flags()
    settings = WorkerSettings(workdir=str(work / "workers"), comfy_path=str(comfy_root), python=comfy_python,
                              args=(*flags, *cs.pinned_cache(comfy_root)), env={**launch_env(), **env})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = cs.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(settings, workers=2), name="multilora", route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "workdir": work / "workers"}
    finally:
        serve.shutdown()
        ray.shutdown()


def generate(ingress, prompt: dict) -> dict:
    status, out = http(ingress["url"] + "/generate", {"prompt": prompt})
    assert status == 200, out
    return out


def test_two_stacks_sent_in_turn_stay_on_one_worker_each(ingress):
    urls = live_workers(ingress["workdir"])
    before = {w: reads(url) for w, url in urls.items()}
    placed = {"A": set(), "B": set()}
    for i in range(3):
        for name, stack in (("A", STACK_A), ("B", STACK_B)):
            placed[name].add(generate(ingress, stack_prompt(stack, seed=i))["worker"])
    assert len(placed["A"]) == 1 and len(placed["B"]) == 1, f"a stack moved between workers: {placed}"
    files = {"A": {n for n, _ in STACK_A}, "B": {n for n, _ in STACK_B}}
    for w, url in urls.items():
        mine = set().union(*(files[s] for s in placed if w in placed[s]))  # the stacks sent to w: none, one or both
        misses, cached = reads(url)
        assert misses - before[w][0] == len(mine - before[w][1]), (w, mine, before[w], misses)  # each read once
        assert cached - before[w][1] <= mine, f"worker {w} read {cached - before[w][1] - mine}, another's files"
        _, resident = http(url + "/multilora/resident")
        assert mine <= set(resident["loras"]), resident
        if mine:
            assert f"checkpoints/{wf.synth.CHECKPOINT_NAME}" in resident["bases"], resident


def test_a_prompt_through_the_ingress_gives_the_image_it_gives_straight(ingress, direct):
    for url in live_workers(ingress["workdir"]).values():
        cs.ComfyServer.attach(url).free()  # as the direct runs started: no model loaded, the slots new
    out = generate(ingress, direct["example"])
    assert len(out["images"]) == 1
    got = png(out["images"][0]["png"])
    first, again = direct["images"]
    repeat = mad(first, again)  # the host's own repeatability in this run: 0 where it is deterministic
    assert mad(got, first) <= 3 * repeat, (
        f"ingress image differs from the direct one by {mad(got, first):.4f} (MAD); two direct runs by {repeat:.4f}")


@pytest.mark.parametrize("case", sorted(refused_prompts()))
def test_a_prompt_comfyui_refuses_gets_comfyuis_own_answer(ingress, direct, case):
    status, out = http(ingress["url"] + "/prompt", {"prompt": refused_prompts()[case]})
    assert status == 400
    assert out == direct["refusals"][case]


def test_an_unknown_prompt_id_is_a_404(ingress):
    status, out = http(ingress["url"] + "/history/00000000-0000-0000-0000-000000000000")
    assert status == 404 and "no prompt" in out["error"]
    status, _ = http(ingress["url"] + "/view?filename=nothing.png&type=output")
    assert status == 404


def test_a_killed_worker_fails_its_prompt_and_a_new_worker_serves_the_next(ingress):
    before = workers(ingress["workdir"])
    status, queued = http(ingress["url"] + "/prompt", {"prompt": stack_prompt(STACK_KILLED, seed=99, steps=40)})
    assert status == 200, queued
    victim, prompt_id = queued["worker"], queued["prompt_id"]
    url = before[victim]
    deadline = time.monotonic() + 120
    while not http(url + "/queue")[1]["queue_running"]:  # sampling, not only queued
        assert time.monotonic() < deadline, "the prompt did not start on its worker"
        time.sleep(0.2)
    os.kill(int((ingress["workdir"] / victim / "pid").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    while True:
        status, history = http(ingress["url"] + f"/history/{prompt_id}")
        entry = history.get(prompt_id) if status == 200 else None
        if entry:
            break
        assert time.monotonic() - killed < ERROR_WITHIN_S, f"no error for {prompt_id} {ERROR_WITHIN_S:.0f} s after the kill"
        time.sleep(0.5)
    assert entry["status"]["status_str"] == "error"
    assert "stopped" in entry["status"]["messages"][0][1]["exception_message"]
    while not (new := set(workers(ingress["workdir"])) - set(before)):
        assert time.monotonic() - killed < NEW_WORKER_WITHIN_S, "Ray started no new worker"
        time.sleep(1.0)
    from ray import serve
    while serve.status().applications["multilora"].deployments["ComfyWorker"].replica_states.get("RUNNING") != 2:
        assert time.monotonic() - killed < NEW_WORKER_WITHIN_S, "the new worker did not come up"
        time.sleep(0.5)
    time.sleep(2.0)  # Ray tells the ingress's router of the new replica (a long poll: well under this)
    # Two prompts sent together: the router sends the second to the least loaded worker, so each worker takes one.
    sent = []
    for stack, seed in ((STACK_A, 101), (STACK_KILLED, 100)):
        status, queued = http(ingress["url"] + "/prompt", {"prompt": stack_prompt(stack, seed=seed, steps=8)})
        assert status == 200, queued
        sent.append(queued)
    assert len({q["worker"] for q in sent}) == 2 and {q["worker"] for q in sent} & new, sent
    for q in sent:
        while not (entry := http(ingress["url"] + f"/history/{q['prompt_id']}")[1]):
            assert time.monotonic() - killed < NEW_WORKER_WITHIN_S + 300, f"prompt {q} did not finish"
            time.sleep(0.5)
        assert entry[q["prompt_id"]]["status"]["status_str"] == "success", entry
