"""nbexec: run untrusted Python as a notebook in a throwaway, locked-down Docker sandbox."""

from .config import SandboxConfig, from_env
from .engine.budget import OutputCallback
from .engine.execute import execute_notebook, execute_notebook_async
from .engine.judge import judge
from .engine.judgemany import JudgeItem, judge_many, judge_many_async
from .engine.judgevalues import Comparison, JudgeResult, Limits, Test, TestResult
from .engine.manager import SessionManager
from .engine.many import BatchItem, execute_many, execute_many_async
from .engine.options import BatchOptions, ExecuteOptions, RestoreOptions, SessionOptions
from .engine.session import Session
from .errors import (
    CellTooLargeError,
    ClusterFullError,
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
    NotOfferedError,
    PackageError,
    PackageLimitError,
    PackageRefusedError,
    ProtocolError,
    SandboxError,
    SessionBusyError,
    SessionClosedError,
    SessionDeadError,
    SessionError,
    SessionLimitError,
    SessionLostError,
    SessionNotFoundError,
    SessionPendingError,
    ShuttingDownError,
    SnapshotError,
    StorageError,
    WakeStoppedError,
)
from .files.artifacts import Collection
from .files.transfer import FileChunks
from .kinds import ErrorKind, PackageStatus, RestoredBy, SessionStatus, UploadKind, UploadStatus
from .notebook.links import rewrite as rewrite_links
from .overrides import ConfigOverrides, RunOverrides
from .result import CellError, Connection, ExecutionResult, File, Image, Package, SkippedFile, Upload
from .stores.storage import ArtifactStore, LocalStore
from .stores.storage import from_env as store_from_env

__version__ = "0.1.0"

__all__ = [
    "ArtifactStore",
    "BatchItem",
    "BatchOptions",
    "CellError",
    "CellTooLargeError",
    "ClusterFullError",
    "Collection",
    "Comparison",
    "ConfigError",
    "ConfigOverrides",
    "Connection",
    "DiskSpaceError",
    "DockerError",
    "DockerUnavailableError",
    "ErrorKind",
    "ExecuteOptions",
    "ExecutionResult",
    "File",
    "FileChunks",
    "FileTooLargeError",
    "FileTransferError",
    "Image",
    "ImageNotFoundError",
    "JudgeItem",
    "JudgeResult",
    "Limits",
    "LocalStore",
    "NbexecError",
    "NodeError",
    "NodeLostError",
    "NodeUnavailableError",
    "NotOfferedError",
    "NotebookError",
    "OutputCallback",
    "Package",
    "PackageError",
    "PackageLimitError",
    "PackageRefusedError",
    "PackageStatus",
    "ProtocolError",
    "RestoreOptions",
    "RestoredBy",
    "RunOverrides",
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
    "SessionOptions",
    "SessionPendingError",
    "SessionStatus",
    "ShuttingDownError",
    "SkippedFile",
    "SnapshotError",
    "StorageError",
    "Test",
    "TestResult",
    "Upload",
    "UploadKind",
    "UploadStatus",
    "WakeStoppedError",
    "__version__",
    "execute_many",
    "execute_many_async",
    "execute_notebook",
    "execute_notebook_async",
    "from_env",
    "judge",
    "judge_many",
    "judge_many_async",
    "rewrite_links",
    "store_from_env",
]
