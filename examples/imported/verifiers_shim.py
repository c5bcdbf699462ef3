"""The one change `openenv import`'s Verifiers wrapper needed to run under any OpenEnv server (OpenEnv's own
`uvicorn server.app:app` included, not only quaero's): a legacy Verifiers Environment installs SIGINT/SIGTERM
handlers when it is built (verifiers 0.1.x-0.3.x, `Environment.__post_init__`), and the wrapper builds it
lazily inside a session, on a server worker thread, where Python refuses `signal.signal` ("signal only works
in main thread"). Off the main thread the handlers are skipped here (verifiers' atexit teardown stays); the
env class is re-exported unchanged, so its own server app still publishes its Action.
"""
import signal
import threading

from vf_reasoning_gym.server.vf_reasoning_gym_environment import VfReasoningGymEnvironment

_install = signal.signal


def _main_thread_only(signalnum, handler):
    if threading.current_thread() is threading.main_thread():
        return _install(signalnum, handler)
    return signal.getsignal(signalnum)


signal.signal = _main_thread_only

__all__ = ["VfReasoningGymEnvironment"]
