"""The noise ξ every tier reads: laws (:mod:`.laws`, :mod:`.moments`), seeded block streams
(:mod:`.streams`), the compiled CPU Philox stream (:mod:`.cpu_philox`), the collapsed tier's
statistics (:mod:`.statistics`) and the backend decision (:mod:`.backends`)."""
