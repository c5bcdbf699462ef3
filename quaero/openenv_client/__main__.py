"""`python -m quaero.openenv_client serve module:Class [--host H] [--port P] [--fd N]`: the local-server
child."""
import argparse
import json

from .server import serve

ap = argparse.ArgumentParser(prog="python -m quaero.openenv_client")
sub = ap.add_subparsers(dest="command", required=True)
p = sub.add_parser("serve")
p.add_argument("entry")
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, default=8000)
p.add_argument("--fd", type=int, default=None, help="serve on this inherited listening socket")
p.add_argument("--max-concurrent-envs", type=int, default=16)
p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
p.add_argument("--kwargs", type=json.loads, default={}, help="JSON keyword arguments for the entry")
p.add_argument("--action", default=None, help="module:ActionClass, for an env that names no Action itself")
args = ap.parse_args()
serve(args.entry, host=args.host, port=args.port, max_concurrent_envs=args.max_concurrent_envs, fd=args.fd,
      parent_pid=args.parent_pid, kwargs=args.kwargs, action=args.action)
