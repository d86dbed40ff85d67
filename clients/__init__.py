"""The Flower ClientApp for fedlora: de-sketch, local LoRA SGD, clip, privatize, reply.

Empty until the federation milestone (issue 4); the math it will call is in ``fedlora``.
"""
