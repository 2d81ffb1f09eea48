"""Imported last by the forkserver that starts the ranks (``launcher._preload_forkserver``), once it
has imported torch, Lightning, this package and the model's module: it freezes the server's objects
(``gc.freeze``), so that every rank it forks leaves them out of its garbage collections, as the
ranks of a fork launch do (``launcher._frozen_for_fork``). Nothing else imports it: in any other
process it would freeze that process's objects for good."""

import gc

gc.freeze()
