"""The server: processes, scheduling, model execution, HTTP API."""

from strand.runtime.errors import InvalidRequestError
from strand.runtime.sampling_params import SamplingParams
from strand.runtime.server_args import ServerArgs

__all__ = ["InvalidRequestError", "SamplingParams", "ServerArgs"]
