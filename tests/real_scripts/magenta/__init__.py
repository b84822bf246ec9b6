"""Stand-in for the ``magenta`` package around a port of music_vae_train.py.

``models/music_vae/music_vae_train.py`` is a port of the original (its
header lists every change); ``configs`` and ``data`` are small stand-ins with
the interfaces it uses, so that it keeps its original imports.
"""
