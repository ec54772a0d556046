"""moe_comm: graph-capturable dispatch/combine of tokens between GPUs for expert-parallel MoE layers.

The names users need live here; everything else is in the submodules.
"""

from .config import Config, RouterConfig, load_config
from .dispatcher import Dispatcher
from .outputs import DispatchHandle, DispatchOutput, TokenMajorOutput
from .nn.layer import MoELayer, MoEWeights, moe_aux_loss, update_expert_biases
from .nn.overlap import gemm_sm_carveout
from .fp8 import dequantize, quantize
from .protocol import StatusReport
from .errors import (
    BackendError,
    CommTimeoutError,
    CompileError,
    ConfigError,
    DeviceStatusError,
    GroupFailedError,
    InputError,
    MoeCommError,
)

__all__ = [
    "Config",
    "RouterConfig",
    "load_config",
    "Dispatcher",
    "DispatchHandle",
    "DispatchOutput",
    "TokenMajorOutput",
    "StatusReport",
    "MoELayer",
    "MoEWeights",
    "moe_aux_loss",
    "update_expert_biases",
    "gemm_sm_carveout",
    "quantize",
    "dequantize",
    "MoeCommError",
    "ConfigError",
    "InputError",
    "BackendError",
    "CompileError",
    "CommTimeoutError",
    "DeviceStatusError",
    "GroupFailedError",
]

__version__ = "0.1.0"
