"""nbexec: run untrusted Python as a notebook in a throwaway, locked-down Docker sandbox."""

from .config import SandboxConfig, from_env
from .engine.execute import execute_notebook, execute_notebook_async
from .engine.manager import SessionManager
from .engine.session import Session
from .errors import (
    ConfigError,
    DiskSpaceError,
    DockerError,
    DockerUnavailableError,
    FileTooLargeError,
    FileTransferError,
    ImageNotFoundError,
    NbexecError,
    NodeError,
    NodeLostError,
    NodeUnavailableError,
    NotebookError,
    ProtocolError,
    SandboxError,
    SessionBusyError,
    SessionClosedError,
    SessionDeadError,
    SessionError,
    SessionLimitError,
    SessionLostError,
    SessionNotFoundError,
    SnapshotError,
    StorageError,
    WakeStoppedError,
)
from .notebook.links import rewrite as rewrite_links
from .result import CellError, ExecutionResult, File, Image, SkippedFile, Upload
from .stores.storage import from_env as store_from_env

__version__ = "0.1.0"

__all__ = [
    "CellError",
    "ConfigError",
    "DiskSpaceError",
    "DockerError",
    "DockerUnavailableError",
    "ExecutionResult",
    "File",
    "FileTooLargeError",
    "FileTransferError",
    "Image",
    "ImageNotFoundError",
    "NbexecError",
    "NodeError",
    "NodeLostError",
    "NodeUnavailableError",
    "NotebookError",
    "ProtocolError",
    "SandboxConfig",
    "SandboxError",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionDeadError",
    "SessionError",
    "SessionLimitError",
    "SessionLostError",
    "SessionManager",
    "SessionNotFoundError",
    "SkippedFile",
    "SnapshotError",
    "StorageError",
    "Upload",
    "WakeStoppedError",
    "__version__",
    "execute_notebook",
    "execute_notebook_async",
    "from_env",
    "rewrite_links",
    "store_from_env",
]
