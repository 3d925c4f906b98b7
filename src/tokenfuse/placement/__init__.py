"""Where members run: in this process (``placement: local``, the default; ``tokenfuse.placement.local``)
or in Ray actors (``placement: ray``, see ``tokenfuse.placement.ray``)."""
