"""The version of the plugin API.

Plugins declare the range they work with (``Plugin.api = ">=1.0,<2"``); discovery refuses a
plugin whose range excludes this version. Bump the minor version when the API gains something
(old plugins keep working), the major version when something a plugin relies on changes.
"""

API_VERSION = "1.0"
