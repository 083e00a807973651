from arpo_trl.tools.base import Tool, format_result
from arpo_trl.tools.python import PythonTool
from arpo_trl.tools.search import BM25Backend, SearchBackend, SearchTool

__all__ = ["BM25Backend", "PythonTool", "SearchBackend", "SearchTool", "Tool", "format_result"]
