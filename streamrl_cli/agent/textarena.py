"""TextArena's games as StreamRL environments, unchanged (``pip install textarena``).

TextArena (https://github.com/LeonGuertler/TextArena) ships dozens of single- and multi-player text
games behind one API (``ta.make(env_id)``, ``reset``, ``get_observation``, ``step``, ``close``),
and environment collections (OpenEnv, verifiers) wrap it. This adapter runs any single-player game
by its id::

    agent:
      env: streamrl_cli.agent.textarena:TextArenaEnv
      env_args: {env_id: GuessTheNumber-v0}

``reset(row)`` starts a game (seeded by the row's ``seed`` column, if any) and returns its opening
observation as a user message; ``step(turn)`` plays the model's turn as the action and returns only
what is new in the game's observation (TextArena's observation is the whole history: sending it
again would put the past in the context twice), without the echo of the model's own action. The
reward is the game's for player 0 when it ends.
"""

from __future__ import annotations

from typing import Any

PLAYER = 0


class TextArenaEnv:
    def __init__(self, env_id: str, **kwargs: Any):
        import textarena as ta

        self.env = ta.make(env_id=env_id, **kwargs)
        self.env_id = env_id
        self._seen = ""

    def reset(self, row: dict[str, Any]) -> str:
        seed = row.get("seed")
        self.env.reset(num_players=1, seed=int(seed) if seed is not None else None)
        return self._news()

    def step(self, turn: str) -> tuple[str | None, float, bool]:
        done, _ = self.env.step(action=turn)
        if done:
            rewards, _info = self.env.close()
            return None, float((rewards or {}).get(PLAYER, 0.0)), True
        return self._news(), 0.0, False

    def _news(self) -> str:
        _, observation = self.env.get_observation()
        text = observation if isinstance(observation, str) else "\n".join(map(str, observation))
        new = text[len(self._seen) :] if text.startswith(self._seen) else text
        self._seen = text
        lines = [ln for ln in new.splitlines() if not ln.startswith("[Player]")]  # the model's own action
        return "\n".join(lines).strip()
