"""engine/runtime"""
