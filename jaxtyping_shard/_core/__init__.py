"""The ground floor: errors, modes, meshes, sites and what becomes of a failure.

Every stage imports from here; nothing here imports a stage.
"""
