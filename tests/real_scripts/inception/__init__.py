"""Stand-in for tensorflow/models' ``inception`` package, around a port.

``inception_distributed_train.py`` and ``imagenet_distributed_train.py`` are
ports of the originals (their headers list every change); the other modules
are small stand-ins with the interfaces those two use, so that the ports keep
their original imports (``from inception import image_processing``, ...).
"""
