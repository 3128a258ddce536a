"""Fault-tolerance engines (``--engine``): what each is to the rest of the package is one contract,
:class:`.base.Engine`, and :data:`.registry.ENGINES` maps each :class:`~eksft_nb.states.EngineName` to its
engine (:func:`.registry.engine_of` a spec's). NVRx (:mod:`.nvrx`) is the engine the package is built
around; torchft (:mod:`.torchft`) the other. What an engine runs on each backend is the backend's to say
(its ``engine_parts`` module): backends import engines, engines never import backends."""
