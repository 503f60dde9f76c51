"""A thread names itself, as a runtime's threads do: ``prctl(PR_SET_NAME)``.

torch_npu's ``acl_thread`` and ``release_thread`` name themselves this way, so the
stand-in workers do too: the daemon must find the name in
``/proc/<pid>/task/<tid>/comm``, where the kernel keeps at most 15 bytes of it.

Standard library only, and no annotation newer than Python 3.9: the stand-ins run under
other interpreters (a Debian root's, a pod image's, ``python -I -S``). A program run by
path imports it after putting this directory on ``sys.path``; a program passed as a
string (``python -c``) starts with this module's own text (``program``).
"""

import ctypes

PR_SET_NAME = 15  # <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)


def name_self(name):
    """Name the calling thread ``name`` (str or bytes), cut to the kernel's 15 bytes."""
    raw = name.encode() if isinstance(name, str) else bytes(name)
    _libc.prctl(PR_SET_NAME, ctypes.c_char_p(raw[:15]), 0, 0, 0)


def program(body):
    """The text of a program for ``python -c``: this module (``PR_SET_NAME``,
    ``name_self``), then ``body``."""
    import inspect
    import sys

    return inspect.getsource(sys.modules[__name__]) + body
