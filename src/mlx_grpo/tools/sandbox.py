"""The built-in "python" tool's runner: code in a fresh `python -I` subprocess with time, memory and output
limits, no network and no file writes outside its temporary directory (run_python says what holds where)."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import cache

# Runs in the child before the user's code: resource limits, then an audit hook (PEP 578) refusing
# network, program starts, signals outside the process group, and file writes outside the working
# directory. The limits are set here and not in preexec_fn, which is unsafe when the parent has threads
# (the decode loop runs tools from worker threads).
_BOOTSTRAP = r"""
import ast, os, resource, sys, traceback
ROOT = os.path.realpath(os.getcwd())
for limit, value in zip((resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE), map(int, sys.argv[1:4])):
    try:
        resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
        pass  # macOS refuses some RLIMIT_AS values: the wall-time limit still holds
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
               "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
               "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "os.mkfifo": (0,),
               "os.mknod": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,),
               "shutil.copystat": (1,), "shutil.move": (0, 1), "shutil.chown": (0,),
               "shutil.unpack_archive": (1,), "sqlite3.connect": (0,)}
NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
              "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
EXEC_EVENTS = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile"}

def inside(path):
    if isinstance(path, int) or path is None:
        return True  # an fd already open, or an argument that names no path
    real = os.path.realpath(os.fsdecode(path))
    return real == ROOT or real.startswith(ROOT + os.sep) or real == os.devnull

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if ((mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS) and not inside(path):
            raise PermissionError(f"writing outside the working directory is disabled: {path}")
    elif event in PATH_EVENTS:
        for i in PATH_EVENTS[event]:
            if i < len(args) and not inside(args[i]):
                raise PermissionError(f"changing files outside the working directory is disabled: {args[i]}")
    elif event in NET_EVENTS:
        raise PermissionError("network access is disabled in the python tool")
    elif event in EXEC_EVENTS:
        raise PermissionError("starting programs is disabled in the python tool")
    elif (event == "os.kill" and args[0] not in (0, -os.getpgrp())
          and (args[0] < 0 or os.getpgid(args[0]) != os.getpgrp())):
        raise PermissionError("signals to other processes are disabled in the python tool")
    elif event == "os.killpg" and args[0] not in (0, os.getpgrp()):
        raise PermissionError("signals to other processes are disabled in the python tool")

sys.dont_write_bytecode = True
with open("main.py") as f:
    source = f.read()
sys.addaudithook(hook)
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    tree = ast.parse(source, "main.py")
    # Like a notebook cell: a final bare expression is printed, so "2 ** 10" shows 1024.
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "main.py", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "main.py", "eval"), scope)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this bootstrap's frame
    sys.stdout.flush()
    sys.exit(1)
"""
PYTHON_TIMEOUT_S = 10.0
PYTHON_MEMORY_MB = 1024
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: the output file and anything the code writes
_READ_BYTES = 64 * 1024  # output read back; run_tool cuts it further to max_chars


@cache
def _unshare_works() -> bool:
    """Whether `unshare -rn` (a new user + network namespace: no interface but a down loopback) runs
    here. Linux only; containers often forbid user namespaces."""
    exe = shutil.which("unshare")
    if sys.platform != "linux" or exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_python(code: str, timeout_s: float = PYTHON_TIMEOUT_S, memory_mb: int = PYTHON_MEMORY_MB) -> str:
    """Run Python code in a fresh interpreter and return what it printed (stdout and stderr), or the
    traceback. A final bare expression is printed, as in a notebook.

    What holds, and where: the wall-time limit kills the whole process group (children the code forked
    included) on every platform; the memory limit (RLIMIT_AS) holds on Linux, macOS does not enforce
    it; network: on Linux with user namespaces the code runs under `unshare -rn` (no network at all,
    for the code and anything it starts), and everywhere an audit hook refuses socket connect, bind,
    send and name lookups. Writes outside a temporary working directory, starting programs and signals
    to other processes are refused by the audit hook. This is a guard against a model's mistakes, not
    a sandbox against hostile code: ctypes, native extensions or paths relative to a directory file
    descriptor get around an audit hook. Run untrusted code in a container.

    Args:
        code: Python source code to run; use print() to show results.
    """
    cmd = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(memory_mb * 2**20),
           str(math.ceil(timeout_s) + 1), str(MAX_FILE_BYTES)]
    if _unshare_works():
        cmd = [shutil.which("unshare"), "-rn", *cmd]
    base = tempfile.mkdtemp(prefix="mlx-grpo-python-")
    work, output_path = os.path.join(base, "work"), os.path.join(base, "output")
    env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # BLAS thread pools reserve address space
    try:
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        with open(output_path, "wb") as out:
            # A new session makes the child a process-group leader: one killpg reaches its forks too.
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # also after a normal exit: children it left running die with it
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        with open(output_path, "rb") as f:
            text = f.read(_READ_BYTES).decode("utf-8", errors="replace")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if timed_out:
        return f"{text.rstrip()}\nError: timed out after {timeout_s:g} s".lstrip()
    if proc.returncode < 0:  # e.g. SIGXCPU from the CPU-time limit
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else ""
        return f"{text.rstrip()}\nError: killed by signal {name or -proc.returncode}".lstrip()
    return text
