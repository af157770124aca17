import enum

from . import errors as errors
from ._qccl import Comm as Comm
from ._qccl import __version__ as __version__
from ._qccl import unique_id as unique_id
from .errors import *

class ReduceOp(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4
