"""Keeping bound workers bound, between requests.

The rules, pure and tested as tables of values: lifecycle.py (what one look at
a bound worker calls for: drop it, pin its new threads, re-assert drifted masks,
leave it alone, move its memory again; and what goes back to the host when a
worker leaves), blame.py (who moved a mask, on evidence), bans.py (who lifts an
irqbalance ban), proof.py (whether a binding is proven to drive its NPUs: only a
proven one is isolated and holds its NPUs). The shell around them: reconcile.py
(the loop: look, ask the rules, hand the actions to the ``Daemon``), observe.py
(one look at a worker's threads), threadevents.py (the kernel's process events),
evidence.py (what the blame rule weighs), npucheck.py (npu-smi's table asked
about named and unproven binds after their answers, the unproven ones again
until listed), locality.py (how much of a worker's memory is on its nodes,
measured off the loop), memmove.py (the memory moves, each on a thread of its
own). held.py is one held worker's record, with the loop's memory of it.

memmove.py lives here, not beside the bind, because a move is background work
on a worker already bound: the bind queues the first one and answers, the
locality check queues the reruns, a restarted daemon resumes an unfinished
one; and like the rest of this room it never holds the daemon's lock while it
waits on the host.

Nothing here changes the held table or a record in it: the actions go to the
``Daemon``, which alone carries them out. The one exception is a record's thread
cache, which observe.py keeps current as it looks.

May import: from the daemon, state/, runtime/ and api/requests.py; from the rest of ascendbind, anything.
"""
