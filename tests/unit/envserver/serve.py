"""An environment server in a process of its own, for the tests: `python serve.py SETTINGS_JSON TOKEN`
prints its port once it serves, then serves until it is killed."""

from __future__ import annotations

import asyncio
import json
import sys

from streamrl_cli.agent.env_host import EnvSettings
from streamrl_cli.envserver.server import EnvServer


async def main() -> None:
    server = EnvServer(EnvSettings(**json.loads(sys.argv[1])), sys.argv[2], bind_host="127.0.0.1")
    port = await server.start()
    print(port, flush=True)
    try:
        await server.serve()
    finally:
        await server.close()


if __name__ == "__main__":
    asyncio.run(main())
