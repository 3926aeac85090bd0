"""The version of the plugin API.

Plugins declare the range they work with (``Plugin.api = ">=1.0,<2"``); discovery refuses a
plugin whose range excludes this version. Bump the minor version when the API gains something
(old plugins keep working), the major version when something a plugin relies on changes.

1.1: the ``lmlab_train_batch_end`` hook receives ``log`` (is this a logging step); ``FFNModule.skip``
     leaves a block without its ffn part; ``_no_weight_decay`` on a parameter exempts it from decay.

1.2: ``RunInfo`` carries ``variant`` (the seedless name) and ``environment``; ``Tracker.closing_note``
     lets a tracker say something after a sweep (how to sync offline runs).
"""

API_VERSION = "1.2"
