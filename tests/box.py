"""The smallest Stateful, for tests that register plain state: it returns whatever it was given."""

from __future__ import annotations

from typing import Any


class Box:
    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state
