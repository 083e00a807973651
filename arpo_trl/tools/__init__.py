from arpo_trl.tools.base import Tool, ToolEnvironmentError, format_result
from arpo_trl.tools.browse import (
    BrowseError,
    BrowseTool,
    ExtractiveCondenser,
    FetchError,
    HTTPBackend,
    ModelCondenser,
    Page,
    PageBackend,
    PageNotFound,
    PageStore,
    TokenCounter,
)
from arpo_trl.tools.python import PythonTool
from arpo_trl.tools.search import BM25Backend, SearchBackend, SearchTool

__all__ = [
    "BM25Backend", "BrowseError", "BrowseTool", "ExtractiveCondenser", "FetchError", "HTTPBackend", "ModelCondenser",
    "Page", "PageBackend", "PageNotFound", "PageStore", "PythonTool", "SearchBackend", "SearchTool", "TokenCounter",
    "Tool", "ToolEnvironmentError", "format_result",
]
