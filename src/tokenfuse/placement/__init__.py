"""Where members run: in this process (``placement: local``, the default) or in Ray actors
(``placement: ray``, see ``tokenfuse.placement.ray``)."""
