"""Tools and the tag format: `Tool` (`base`; the tag format's other half, finding and cutting tags in generated
tokens: `tags`), `PythonTool` in an OS sandbox (`python`, `sandbox`, `sandbox_process`; `_sandbox_child.py` is run by
path), `SearchTool` and `BrowseTool` (`search`, `browse`, `pages`, `condense`), plain functions (`functions`),
forkable environments (`environments`), concurrent calls (`runner`), failing-tool reports
(`failures`).

May import: data (its offline assets: `assets`, `corpora`, `models`).
"""

from arpo_trl.tools.base import Tool, ToolEnvironmentError, format_result
from arpo_trl.tools.browse import BrowseTool
from arpo_trl.tools.condense import ExtractiveCondenser, ModelCondenser, TokenCounter
from arpo_trl.tools.functions import FunctionTool
from arpo_trl.tools.pages import BrowseError, FetchError, HTTPBackend, Page, PageBackend, PageNotFound, PageStore
from arpo_trl.tools.python import PythonTool
from arpo_trl.tools.search import BM25Backend, BM25Index, SearchBackend, SearchTool

__all__ = [
    "BM25Backend", "BM25Index", "BrowseError", "BrowseTool", "ExtractiveCondenser", "FetchError", "FunctionTool",
    "HTTPBackend", "ModelCondenser", "Page", "PageBackend", "PageNotFound", "PageStore", "PythonTool", "SearchBackend",
    "SearchTool", "TokenCounter", "Tool", "ToolEnvironmentError", "format_result",
]
