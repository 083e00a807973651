"""The process side of `arpo_trl.rewards.math_scoring`: run as ``python -I _math_worker.py <control fd>`` (by path, so
that it imports math-verify and nothing of the trainer: no torch, no TRL).

It is a zygote: it imports math-verify once, then, for each `spawn` request on the control socket, receives one
end of a socket pair and forks a worker that scores answers sent on it, one at a time. Forked workers start in
milliseconds, so the parent can kill a worker stuck in a computation (sympy evaluating `9^{9^{9^{9}}}` in C code
ignores signals) and ask for a fresh one. math-verify's own timeouts are disabled (they use SIGALRM, which only
works on a main thread); the parent's kill is the time limit. Workers write nothing to the console: stdout and
stderr go to /dev/null and logging is off.

Control protocol (parent → zygote, one request at a time): ``b"s"`` with an fd attached → the zygote answers
the worker's pid (8 bytes, little endian); ``b"k" + pid`` → the zygote kills and reaps that worker, answers
``b"ok"``. End of file: the zygote kills its workers and exits.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import socket
import struct
import sys
from multiprocessing.connection import Connection

MEMORY_LIMIT_BYTES = 4 << 30  # address space of a worker: a runaway big-int computation fails instead of swapping


MAX_DIGITS = 100_000  # a value with more decimal digits is never evaluated (10^5 digits take milliseconds)
_CAPPED = ("capped", "a number too large to evaluate")


class _TooLarge(Exception):
    pass


def math_score(prediction: str, truths: list[str]) -> float | tuple[str, str]:
    """1.0 if math-verify finds `prediction` equivalent to one of `truths` (as `arpo_trl.rewards` did in-process,
    with math-verify's signal-based timeouts off); `_CAPPED` when the parsed answer holds a number too large to
    evaluate (`9^{9^{9^{9}}}`, `(10^{10})!`), which math-verify's comparison would try to compute."""
    from math_verify import parse, verify

    predicted = parse(f"${prediction}$", parsing_timeout=None)
    if predicted and too_large(predicted[0]):
        return _CAPPED
    for truth in truths:
        gold = parse(f"${truth}$", parsing_timeout=None) or parse(str(truth), parsing_timeout=None)
        if gold and predicted and verify(gold, predicted, timeout_seconds=None):
            return 1.0
    return 0.0


def too_large(expr) -> bool:
    """Whether the (unevaluated) sympy expression has a subexpression whose value would have more than MAX_DIGITS
    digits (an upper bound from its numeric skeleton: powers, factorials, binomials, products)."""
    try:
        _digits(expr)
    except (_TooLarge, OverflowError):
        return True
    return False


def _log10(x: float) -> float:
    return math.log10(x) if x > 1 else 0.0


def _value(digits: float) -> float:
    if digits > 300:
        raise _TooLarge
    return 10.0**digits


def _digits(expr) -> float:
    """An upper bound on log10 |value| of `expr`'s numeric skeleton (0 for what is not a number); raises _TooLarge."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return 0.0
    if expr.is_Rational:  # Integer too
        return max(_log10(abs(int(expr.p))), _log10(int(expr.q)))
    if expr.is_Float:
        return _log10(abs(float(expr)))
    args = [_digits(arg) for arg in expr.args]
    if isinstance(expr, sympy.Pow):
        digits = _value(args[1]) * args[0]
    elif isinstance(expr, (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma)):
        n = _value(args[0])
        digits = n * math.log10(n + 1)
    elif isinstance(expr, sympy.binomial):
        digits = _value(args[1]) * args[0]
    elif isinstance(expr, (sympy.Sum, sympy.Product)):
        terms = math.prod(_value(limit) for limit in args[1:])  # each limit (i, a, b): at most ~b terms
        digits = args[0] * terms if isinstance(expr, sympy.Product) else args[0] + math.log10(terms + 1)
    elif isinstance(expr, sympy.Mul):
        digits = sum(args)
    else:
        digits = max(args, default=0.0) + (1.0 if isinstance(expr, sympy.Add) else 0.0)
    if digits > MAX_DIGITS:
        raise _TooLarge
    return digits


def serve(conn: Connection) -> None:
    """A worker: answer `(prediction, truths)` requests with a float, or `("error", message)`."""
    while True:
        try:
            prediction, truths = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result: object = math_score(prediction, truths)
        except (Exception, RecursionError, MemoryError) as error:  # the answer's fault: it scores 0 in the parent
            result = ("error", f"{type(error).__name__}: {str(error)[:200]}")
        conn.send(result)


def _spawn(control: socket.socket, fd: int) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
            serve(Connection(fd))
        finally:
            os._exit(0)
    os.close(fd)
    control.sendall(struct.pack("<q", pid))
    return pid


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _reap() -> set[int]:
    """Collect the workers that exited on their own (the parent closed their socket); returns their pids."""
    done = set()
    try:
        while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
            done.add(pid)
    except ChildProcessError:
        pass
    return done


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    logging.disable(logging.CRITICAL)
    import math_verify  # noqa: F401  (imported once here, inherited by every worker; an ImportError shows)
    import sympy  # noqa: F401

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    math_score("1", ["1"])  # warm math-verify's lazy imports and caches before any fork
    workers: set[int] = set()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 9, 1)
        except OSError:
            message, fds = b"", []
        if not message:
            break
        workers -= _reap()
        if message[:1] == b"s" and fds:
            workers.add(_spawn(control, fds[0]))
        elif message[:1] == b"k":
            while 0 < len(message) < 9:  # a stream socket may split the request
                message += control.recv(9 - len(message)) or b"\0" * 9
            pid = struct.unpack("<q", message[1:9])[0]
            if pid in workers:  # never a pid that was reaped (and may have been reused)
                _kill(pid)
                workers.discard(pid)
            control.sendall(b"ok")
    for pid in workers:
        _kill(pid)


if __name__ == "__main__":
    main()
