"""Judge items of a batch: ``POST /v1/batches`` takes, beside /v1/execute bodies, items that judge a program.

An item with a ``program`` is a judge item: its program, tests, language, comparison and limits are checked as
`nbexec.judge` checks them (422 for one it would refuse) before the batch is accepted, and its result is the
judgement's JSON (`JudgeResult.to_dict`) under ``judge``. Its program limit is capped by the node's timeout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nbexec.config import SandboxConfig
from nbexec.engine import judge
from nbexec.engine.judgevalues import MAX_ARGS, MAX_CHECKER, MAX_PROGRAM, MAX_TESTS, Comparison, Limits, Test
from nbexec.errors import ConfigError
from nbexec.stores.storage import ArtifactStore

from .batchrecord import Batch
from .batchreuse import Held
from .runs import chosen
from .schemas import IMAGE_FIELD
from .tenants import Tenants


class JudgeTest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stdin: str = Field(default="", description="The test's standard input (text).")
    args: list[str] = Field(default_factory=list, max_length=MAX_ARGS, description="The program's arguments.")
    expected: str | None = Field(default=None, description="What stdout must be; null: the exit status decides.")


class JudgeLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    time: float = 2.0
    memory: str = Field(default="512m", max_length=20)
    output: str = Field(default="16m", max_length=20)
    program: float | None = None


class JudgeBody(BaseModel):
    """One judge item of a batch (docs/judging.md)."""

    model_config = ConfigDict(extra="forbid")
    program: str = Field(max_length=MAX_PROGRAM, description="The program's source.")
    tests: list[JudgeTest] = Field(min_length=1, max_length=MAX_TESTS)
    language: str = Field(default="python", max_length=20, description="python, c, cpp, java, go or rust.")
    compare: Literal["exact", "whitespace", "float", "checker"] = "whitespace"
    tolerance: float = Field(default=1e-6, ge=0)
    checker: str | None = Field(default=None, max_length=MAX_CHECKER, description="Python source defining check().")
    limits: JudgeLimits = Field(default_factory=JudgeLimits)
    image: str | None = IMAGE_FIELD

    def job(self, most: float) -> judge.Job:
        """The judge's job, its program limit within ``most`` seconds; ConfigError for what judge() refuses."""
        limits = self.limits.model_dump()
        limits["program"] = min(limits["program"] or most, most)
        tests = [Test(t.stdin, tuple(t.args), t.expected) for t in self.tests]
        compare = Comparison(mode=self.compare, tolerance=self.tolerance, checker=self.checker)
        return judge.Job.of(self.program, tests, self.language, compare, Limits(**limits))


def is_judge(value: Any) -> bool:
    return isinstance(value, dict) and "program" in value


def load(line: bytes) -> JudgeBody | None:
    """The judge item a batch kept as ``line``, or None when the line is not one (an execute body)."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # a record tampered with: the execute body's parse says so
        return None
    return JudgeBody.model_validate(value) if is_judge(value) else None


def check(body: JudgeBody, most: float) -> judge.Job:
    """The item's job, its program limit within ``most`` seconds; ConfigError when judge() would refuse it."""
    try:
        return body.job(most)
    except TypeError as exc:  # a value pydantic let through that the values refuse by type
        raise ConfigError(str(exc)) from None


def problems(exc: ValidationError) -> list[dict[str, Any]]:
    """What a 422 says of a body pydantic refused: where and why, for its first ten problems."""
    return [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]]


def work(folders: Tenants, policy: SandboxConfig, store: ArtifactStore | None, batch: Batch, execution_id: str,
         body: JudgeBody, held: Held | None = None) -> Callable[[Any], dict[str, Any]]:
    """What judges ``body`` on the token's thread, in a one-shot session of the batch's (interrupted with it), or
    with ``reuse=batch`` in the sandbox its worker keeps (``held``: batchreuse)."""
    try:
        job = body.job(folders.capped(None))
    except ConfigError as exc:  # checked at the post; a record changed since: this item's error
        raise HTTPException(422, str(exc)[:300]) from None
    config = chosen(policy, body.image).replace(language="python")
    if held is not None:
        return lambda _: _reused(folders, store, batch, execution_id, job, config, held)
    session = folders.one_shot(execution_id, store, batch.shown.id, config)
    batch.sessions[execution_id] = session

    def render(_: Any) -> dict[str, Any]:
        folders.keep(batch.owner, execution_id, session)
        try:  # an image without the language's compiler: a ConfigError, the item's 400 (Runs.run maps it)
            judged = judge.run(session, job)
            return {"ok": judged.ok, "judge": judged.to_dict()}
        finally:
            folders.finish_one_shot(execution_id)

    return render


def _reused(folders: Tenants, store: ArtifactStore | None, batch: Batch, execution_id: str, job: judge.Job,
            config: SandboxConfig, held: Held) -> dict[str, Any]:
    """``job`` judged in the worker's kept sandbox, or in a new one recorded under this item's id (its folder's);
    after it, the sandbox is reset and kept, or closed."""
    session = held.take(config)
    fresh = session is None
    if session is None:
        session = folders.one_shot(execution_id, store, batch.shown.id, config)
        folders.keep(batch.owner, execution_id, session)
    batch.sessions[execution_id] = session
    judged = held.kept.judged(session, job, fresh=fresh)
    return {"ok": judged.ok, "judge": judged.to_dict()}
