"""The estimators of each tier; :func:`mcgraph.expectation` dispatches between them."""

from .chunked import ChunkedMC, chunked_value
from .collapsed import collapsed_value, statistics
from .direct import direct_loop_value, direct_value
from .fused import FusedElementwiseMC, fused_value

__all__ = ["ChunkedMC", "FusedElementwiseMC", "chunked_value", "collapsed_value", "direct_loop_value",
           "direct_value", "fused_value", "statistics"]
