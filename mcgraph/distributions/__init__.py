"""Distribution families that ``torch.distributions`` lacks.

Each is a :class:`torch.distributions.Distribution` subclass following torch's
shape, validation and ``rsample`` conventions; its standard noise is drawn with
plain ``torch.randn`` / ``torch.rand`` calls on the global RNG, so
``torch.manual_seed`` reproduces samples.
"""

from mcgraph.distributions.horseshoe import Horseshoe
from mcgraph.distributions.log_uniform import LogUniform
from mcgraph.distributions.logistic import Logistic
from mcgraph.distributions.radial import Radial, radial_noise, radial_noise_entropy
from mcgraph.distributions.rayleigh import Rayleigh
from mcgraph.distributions.scale_mixture import ScaleMixtureNormal

__all__ = [
    "Horseshoe",
    "LogUniform",
    "Logistic",
    "Radial",
    "Rayleigh",
    "ScaleMixtureNormal",
    "radial_noise",
    "radial_noise_entropy",
]
