"""Applications on top of the library: the training command line (:mod:`.train`), datasets that ship in
packages (:mod:`.data`), the multi-process launcher (:mod:`.launch`) and the benchmark CLI (:mod:`.bench`).
They import the library; the library never imports them.
"""
