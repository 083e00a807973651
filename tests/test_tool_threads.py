"""Plain sync functions run as `GRPOTrainer` runs them: on the training thread, one call at a time. A tool that uses
`signal.alarm` for its own timeout, one that keeps thread-local state and one that uses a client bound to its thread
(sqlite3) all work in a real `ARPOTrainer` step with the tiny tool model, which writes `<python>…</python>` calls;
the rollout still generates while those calls run (its loop on a thread of its own), and a call past `tool_timeout`
still answers its path with a timeout."""

import asyncio
import signal
import sqlite3
import threading
import time

import pytest

from arpo_trl import ARPOConfig, ARPOTrainer
from arpo_trl.tools.functions import FunctionTool
from arpo_trl.tools.runner import ToolRunner

THREADS: list[threading.Thread] = []


def _alarm(signum, frame):
    raise TimeoutError("python tool timed out")


def signal_python(code: str) -> str:
    """
    Runs Python code under its own 5-second alarm, as TRL's agent example does.

    Args:
        code: The code.
    """
    THREADS.append(threading.current_thread())
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(5)
    try:
        return f"ran {len(code)} characters"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


SESSION = threading.local()


def thread_local_python(code: str) -> str:
    """
    Runs Python code in the session opened for this thread.

    Args:
        code: The code.
    """
    THREADS.append(threading.current_thread())
    return f"{SESSION.name}: {code}"


def sqlite_python(code: str) -> str:
    """
    Stores the code in a sqlite database opened by the training script.

    Args:
        code: The code.
    """
    THREADS.append(threading.current_thread())
    DATABASE.connection.execute("insert into calls values (?)", (code,))
    return str(DATABASE.connection.execute("select count(*) from calls").fetchone()[0])


class DATABASE:
    connection: sqlite3.Connection | None = None


def _args(tmp_path, **kw):
    return ARPOConfig(**{
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 48, "max_steps": 1, "logging_steps": 1, "use_cpu": True, "bf16": False,
        "report_to": "none", "save_strategy": "no", "log_trees": False, "tool_call_format": "tags", "seed": 0, **kw})


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.mark.parametrize("tool,scheduler", [(signal_python, "auto"), (thread_local_python, "auto"),
                                            (sqlite_python, "auto"), (signal_python, "waves")])
def test_sync_functions_run_on_the_training_thread_in_a_real_step(tool, scheduler, tool_model_dir, tokenizer,
                                                                   addition_dataset, tmp_path):
    SESSION.name = "main session"  # set on this (the training) thread only
    DATABASE.connection = sqlite3.connect(":memory:")  # check_same_thread: usable on this thread only
    DATABASE.connection.execute("create table calls (code text)")
    THREADS.clear()
    tool.__name__ = "python"  # the tool model calls `<python>`
    trainer = ARPOTrainer(model=str(tool_model_dir), reward_funcs=constant_reward,
                          args=_args(tmp_path, rollout_scheduler=scheduler), train_dataset=addition_dataset,
                          processing_class=tokenizer, tools=[tool])
    assert trainer.sampler.scheduler.event_driven == (scheduler == "auto")
    trainer.train()
    logged = next(e for e in trainer.state.log_history if "arpo/tool_calls_per_group" in e)
    assert logged["arpo/tool_calls_per_group"] > 0 and THREADS  # the model made calls, the function ran them
    assert logged["arpo/tool_failures_per_group"] == 0  # as under GRPOTrainer: no call failed
    assert set(THREADS) == {threading.main_thread()}


def slow(seconds: str) -> str:
    """
    Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(float(seconds))
    return "woke"


def test_a_call_on_this_thread_keeps_its_deadline_and_the_others_wait_for_it():
    runner = ToolRunner(max_workers=2, timeout=0.2)
    tool = FunctionTool(slow)
    assert not tool.thread_safe
    late = runner.submit(lambda: tool("0.5"), here=True)
    quick = runner.submit(lambda: tool("0"), here=True)
    elsewhere = runner.submit(lambda: threading.current_thread(), here=False)
    started = time.monotonic()
    runner.serve([late, quick, elsewhere])
    assert late.result().timed_out and late.result().value is None  # answered at its deadline, result dropped
    assert quick.result().value == "woke" and time.monotonic() - started >= 0.5  # ran once the late call returned
    assert elsewhere.result().value is not threading.main_thread()
    runner.close()


def test_ctrl_c_in_a_call_on_this_thread_stops_the_rollout():
    def interrupted():
        raise KeyboardInterrupt

    runner = ToolRunner(max_workers=1, timeout=5)
    future = runner.submit(interrupted, here=True)
    with pytest.raises(KeyboardInterrupt):
        runner.serve([future])
    assert isinstance(future.result().error, KeyboardInterrupt)
    runner.close()


def lookup(key: str) -> str:
    """
    Looks a key up in a service the run cannot reach.

    Args:
        key: The key.
    """
    raise ConnectionError("service unreachable")


def _failing_run(hermes, addition_dataset, tmp_path, patience):
    from test_function_tools import call, constant_reward, scripted
    from test_tool_calls import ScriptedEngine
    from tiny import tiny_model

    args = _args(tmp_path, max_steps=3, max_completion_length=400, tool_call_format="chat_template",
                 max_failed_tool_steps=patience)
    return ARPOTrainer(model=tiny_model(hermes), reward_funcs=constant_reward, args=args,
                       train_dataset=addition_dataset, processing_class=hermes, tools=[lookup],
                       engine=ScriptedEngine(hermes, scripted([call("lookup", {"key": "pi"})])))


def test_a_tool_whose_calls_all_fail_is_reported_once_then_stops_the_run(hermes, addition_dataset, tmp_path, caplog):
    from arpo_trl.tools.failures import ToolFailingError

    trainer = _failing_run(hermes, addition_dataset, tmp_path, patience=2)
    with caplog.at_level("WARNING", logger="arpo_trl.tools.failures"), \
            pytest.raises(ToolFailingError, match="'lookup' failed in each of the last 2 training steps") as stopped:
        trainer.train()
    assert trainer.state.global_step == 1  # stopped in the second step's rollout
    reports = [r.getMessage() for r in caplog.records if r.name == "arpo_trl.tools.failures"]
    assert len(reports) == 1 and "every call of the tool 'lookup' failed in this step (4 of 4" in reports[0]
    for text in (reports[0], str(stopped.value)):
        assert "ConnectionError: service unreachable" in text
        assert 'from test_tool_threads import lookup; lookup(**{"key": "pi"})' in text
    assert "Traceback" in reports[0] and "raise ConnectionError" in reports[0]
    assert "max_failed_tool_steps=0" in str(stopped.value)


def test_a_streak_ends_when_a_call_succeeds_and_the_user_may_opt_out(caplog):
    from arpo_trl.tools.failures import ToolFailureWatch, ToolTally

    failing, partly = ToolTally(calls=4, failures=4, first_error="Error: x"), ToolTally(calls=4, failures=3)
    watch, never = ToolFailureWatch([FunctionTool(lookup)], patience=2), ToolFailureWatch([], patience=0)
    with caplog.at_level("WARNING", logger="arpo_trl.tools.failures"):
        for _ in range(3):
            watch.observe({"lookup": failing})
            watch.observe({"lookup": ToolTally()})  # no calls: changes nothing
            watch.observe({"lookup": partly})  # ends the streak
        for _ in range(5):
            never.observe({"lookup": failing})
    assert len(caplog.records) == 2  # once per run each
    assert "training goes on" in caplog.records[1].getMessage()


def test_paths_generate_while_a_sync_call_runs_on_this_thread_past_its_deadline(hermes):
    """Event-driven: one path's sync call sleeps on the training thread past `tool_timeout`; the rollout's loop, on a
    thread of its own, goes on generating the other paths meanwhile, and the late call is answered with a timeout."""
    from test_function_tools import call
    from test_tool_calls import ScriptedEngine

    from arpo_trl.generation.engine import EngineTraits
    from arpo_trl.rollout.tool_calls import make_call_format
    from arpo_trl.runtime import BranchingSampler

    generated_at: list[float] = []

    class EventEngine(ScriptedEngine):
        traits = EngineTraits(event_driven=True)

        async def agenerate(self, prefix, max_new_tokens, stop):
            generated_at.append(time.monotonic())
            return self.generate([prefix], [max_new_tokens], stop)[0]

    def nap(seconds: float) -> str:
        """
        Sleeps on the training thread.

        Args:
            seconds: How long.
        """
        THREADS.append(threading.current_thread())
        time.sleep(seconds)
        return "rested"

    THREADS.clear()
    lengths = iter([0.6] + [0.0] * 20)  # the first call is late; the others are quick

    def script(text, rng):
        if "</tool_response>" not in text:
            return f"go {call('nap', {'seconds': next(lengths)})}", 1.0, "stop"
        return "done", 1.0, "eos"

    tools = [FunctionTool(nap)]
    fmt = make_call_format("auto", hermes, tools)
    sampler = BranchingSampler(EventEngine(hermes, script), hermes, tools, call_format=fmt, num_generations=4,
                               branch_policy="none", max_completion_length=400, tool_timeout=0.3, scheduler="events")
    started = time.monotonic()
    result = sampler.sample(fmt.prompt_ids([[{"role": "user", "content": "Rest."}]]))
    assert set(THREADS) == {threading.main_thread()} and len(THREADS) == 4
    failed = [c for t in result.trajectories for c in t.calls if c.failed]
    assert len(failed) == 1  # the late call: answered with a timeout at its deadline
    texts = [hermes.decode(t.completion_ids) for t in result.trajectories]
    assert sum("timed out after 0.3 s" in text for text in texts) == 1 and sum("rested" in text for text in texts) == 3
    assert any(started + 0.05 < moment < started + 0.6 for moment in generated_at)  # generated during the nap


def test_async_functions_share_one_event_loop_across_calls_as_under_trl():
    """A client an async tool opens once (an HTTP session) is bound to the loop it was opened on."""
    loops = set()

    async def fetch(url: str) -> str:
        """
        Fetches a page with a session opened once.

        Args:
            url: The page.
        """
        loops.add(asyncio.get_running_loop())
        return url

    tool = FunctionTool(fetch)
    assert tool.thread_safe  # on the workers, concurrently
    runner = ToolRunner(max_workers=3, timeout=5)
    futures = [runner.submit(lambda: tool("a")) for _ in range(6)]
    runner.serve(futures)
    assert [f.result().value for f in futures] == ["a"] * 6 and len(loops) == 1
    runner.close()
