"""Rewards for a code-writing model, computed by Ray actors in nbexec sandboxes (the shape of a verl-style trainer).

A trainer on Ray hands each rollout worker's programs to a reward actor. The actor judges them against tests in
sandboxes on the cluster's nodes (``source="ray"``), and keeps a session per multi-turn episode, so the model's
tool calls share state. Nothing here starts a sandbox on the trainer's own machine.

    RAY_ADDRESS=head:6379 python examples/ray_rewards.py

Every node needs nbexec with its ``ray`` extra, Docker and the runtime image (docs/ray.md). NBEXEC_* settings of
this process (never its tokens or keys) reach the actors through Ray's runtime environment.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ray

import nbexec

ACTORS = 2


@ray.remote(num_cpus=0)
class CodeReward:
    """One reward worker. Its sandboxes live on the cluster's nodes, placed by free capacity."""

    def __init__(self) -> None:
        self.config = nbexec.SandboxConfig(source="ray", pool_size=0)
        self.episodes: dict[str, nbexec.Session] = {}

    def score(self, program: str, tests: list[dict[str, str]]) -> dict[str, Any]:
        """The share of tests passed: the reward of one single-turn rollout."""
        result = nbexec.judge(program, tests, config=self.config)
        return {"reward": result.passed / len(result.tests), "verdict": result.verdict}

    def score_many(self, programs: list[str], tests: list[dict[str, str]]) -> list[float]:
        """A group of rollouts for one problem, judged in a few reused sandboxes."""
        rewards = [0.0] * len(programs)
        items = [{"program": p, "tests": tests} for p in programs]
        for item in nbexec.judge_many(items, reuse="batch", concurrency=2, config=self.config):
            if item.error is not None:  # nbexec failed (a full cluster, a lost node): no reward to give
                raise item.error
            if item.result is not None:
                rewards[item.index] = item.result.passed / len(item.result.tests)
        return rewards

    def step(self, episode: str, code: str) -> dict[str, Any]:
        """One tool call of a multi-turn episode: its session keeps the variables of the calls before."""
        session = self.episodes.get(episode)
        if session is None:
            session = self.episodes[episode] = nbexec.Session(self.config, keep_files=False)
        result = session.run(code)
        return {"ok": result.ok, "stdout": result.stdout, "error": result.error.ename if result.error else None,
                "node": result.node}

    def end(self, episode: str) -> None:
        session = self.episodes.pop(episode, None)
        if session is not None:
            session.close()


def main() -> dict[str, Any]:
    # Settings, not secrets: anyone on the cluster can read a job's runtime environment.
    settings = {k: v for k, v in os.environ.items()
                if k.startswith("NBEXEC_") and not any(word in k for word in ("TOKEN", "KEY", "SECRET", "PASSWORD"))}
    if not ray.is_initialized():
        ray.init(runtime_env={"env_vars": settings}, log_to_driver=False)
    actors = [CodeReward.remote() for _ in range(ACTORS)]  # type: ignore[attr-defined]
    tests = [{"stdin": "3 4", "expected": "7"}, {"stdin": "10 -2", "expected": "8"}]
    rollouts = ["print(sum(map(int, input().split())))", "a, b = input().split()\nprint(a + b)",
                "print(7)"]
    single = ray.get([actors[i % ACTORS].score.remote(p, tests) for i, p in enumerate(rollouts)])
    group = ray.get(actors[0].score_many.remote(rollouts, tests))
    turns = [ray.get(actors[1].step.remote("episode-1", code))
             for code in ("data = [3, 1, 2]", "data.sort()\nprint(data)", "print(undefined)")]
    ray.get(actors[1].end.remote("episode-1"))
    return {"single": single, "group": group, "turns": turns}


if __name__ == "__main__":
    print(json.dumps(main()))
