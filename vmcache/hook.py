"""The libvirt hook's entry point: ``python -I -m vmcache.hook --config FILE DOMAIN OP SUBOP EXTRA``.

A stable name that installed hook files (and operators' own hooks that
chain to vmcache) call; the hook itself is :mod:`vmcache.service.hook`.
"""

if __name__ == "__main__":
    from .service.hook import run_and_exit

    run_and_exit()
