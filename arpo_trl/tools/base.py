"""A tool is a tag plus a callable `str -> str`: the model writes `<tag>content</tag>`, the sampler
stops at `</tag>`, calls the tool on `content` and appends ` <result>\\n…\\n</result>` as context."""

from __future__ import annotations

from collections.abc import Callable


class Tool:
    """A tag tool. Subclass and override `__call__`, or pass `fn`::

        calculator = Tool("calc", lambda expr: str(eval(expr, {"__builtins__": {}})))
    """

    def __init__(self, tag: str, fn: Callable[[str], str] | None = None):
        if not tag or not tag.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"Tool tag must be a non-empty alphanumeric name (e.g. 'python'), got {tag!r}.")
        if tag == "result":
            raise ValueError("Tool tag 'result' is reserved for the inserted tool output.")
        self.tag = tag
        self._fn = fn

    @property
    def open_tag(self) -> str:
        return f"<{self.tag}>"

    @property
    def close_tag(self) -> str:
        return f"</{self.tag}>"

    def __call__(self, content: str) -> str:
        if self._fn is None:
            raise NotImplementedError(f"{type(self).__name__} needs `fn` or an overridden __call__.")
        return self._fn(content)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tag={self.tag!r})"


def format_result(text: str) -> str:
    """The reference's result block (VRT L422): a leading space, the output on its own lines."""
    return f" <result>\n{text}\n</result>"
